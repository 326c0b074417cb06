"""Generated packages for the distributed tests, and torchrun as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fxpipe.codegen import load_package
from fxpipe.frontend import ModelSource, Traced, load_model_file, trace
from tests.codegen._models import mini_batch, write_package
from tests.codegen._plans import contiguous_plan

__all__ = ["EXAMPLES", "ROOT", "assert_model_grads", "contiguous_plan", "import_package",
           "load", "mini_batch", "torchrun", "write_package"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TORCHRUN_TIMEOUT_S = 300


def load(model: str) -> tuple[ModelSource, Traced]:
    source = load_model_file(model)
    return source, trace(source.model, source.args, source.kwargs,
                         batch_dims=source.batch_dims)


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


def assert_model_grads(saves: list[dict[str, Any]], expected: dict[str, torch.Tensor],
                       tolerance: float, which: Mapping[str, int] | None = None) -> None:
    """Every rank's whole gradients (its save's ``grads``) are the unsplit model's (to
    ``tolerance`` of the largest), and between them the ranks hold every parameter
    (``which``: the parameter each name is, where a tied one's names differ by stage)."""
    largest = max(float(g.abs().max()) for g in expected.values())
    seen = set()
    for rank, save in enumerate(saves):
        for name, grad in save["grads"].items():
            seen.add(name)
            error = float((grad - expected[name]).abs().max())
            assert error <= tolerance * largest, (rank, name, error, largest)
    same = which or {name: name for name in expected}
    assert {same[name] for name in seen} == set(same.values())
