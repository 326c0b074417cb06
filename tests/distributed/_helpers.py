"""Generated packages for the distributed tests, and torchrun as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from fxpipe.codegen import generate, load_package
from fxpipe.frontend import ModelSource, Traced, load_model_file, trace
from fxpipe.plan import Estimate, Plan, SolverReport, StagePlan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TORCHRUN_TIMEOUT_S = 300


def load(model: str) -> tuple[ModelSource, Traced]:
    source = load_model_file(model)
    return source, trace(source.model, source.args, source.kwargs)


def contiguous_plan(
    graph: torch.fx.Graph, num_stages: int, *, schedule: str = "1f1b", microbatches: int = 2,
    replicas: tuple[int, ...] | None = None, virtual_stages: int = 1,
) -> Plan:
    """The graph's ops (a topological order) in K near-equal contiguous chunks, stage k
    on ``replicas[k]`` GPUs (default 1), or interleaved (``virtual_stages`` > 1: stage k
    on GPU k % (K / v)); a get_attr node goes with its first user."""
    replicas = replicas or (1,) * num_stages
    ops = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    stage_of = {node.name: i * num_stages // len(ops) for i, node in enumerate(ops)}
    for node in graph.nodes:
        if node.op == "get_attr":
            stage_of[node.name] = min((stage_of[u.name] for u in node.users), default=0)
    order = [n.name for n in graph.nodes if n.name in stage_of]
    stages = tuple(
        StagePlan(index=k, nodes=tuple(n for n in order if stage_of[n] == k), recompute=False,
                  replicas=replicas[k])
        for k in range(num_stages)
    )
    return Plan(
        num_stages=num_stages,
        schedule=schedule,
        microbatches=microbatches,
        stages=stages,
        solver=SolverReport("hand-written", "HEURISTIC", 0.0, 0.0, 0.0),
        estimate=Estimate(0.0, 0.0, 0.0, 0, True),
        model="test",
        virtual_stages=virtual_stages,
    )


def write_package(directory: Path, traced: Traced, plan: Plan) -> dict[str, str]:
    files = generate(traced, plan)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text, encoding="utf-8")
    return files


def mini_batch(value: object) -> object:
    """M = 2 micro-batches: the example and the example reversed along dim 0."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: torch.cat([t, t.flip(0)]) if t.dim() else t, value
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, script: Path, *args: str, timeout: float = TORCHRUN_TIMEOUT_S
             ) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node nproc script args`` on the CPU (gloo)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
        str(script), *args,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def import_package(directory: Path, name: str) -> object:
    """Import a generated package from ``directory`` as ``name``."""
    return load_package(directory, name)
