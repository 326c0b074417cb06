"""A plan's layout under torchrun: ``fxpipe split examples/gpt.py --gpus 4 --pp 2
--dp-mode fsdp|ddp`` plans 2 pipelines of 2 stages, and its train_torchrun.py runs them on
torch's own (dp, pp) DeviceMesh, each stage sharded by FSDP2 or replicated by DDP over
its dp sub-mesh. On the GPT (its embedding tied to its LM head across the cut), one step
on the global batch gives every parameter the unsplit model's gradient, clipped as
torch's ``clip_grad_norm_`` clips the unsplit model's, and every rank holds the bytes of
parameters, gradients and Adam state that plan.json says for its stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe import cli

from ._helpers import EXAMPLES, load, torchrun

GPT = EXAMPLES / "gpt.py"
CLIP = 0.5  # below the step's gradient norm (0.67 on this batch): clipping scales


def _split(out: Path, mode: str, schedule: str = "1f1b", gpus: int = 4) -> dict[str, Any]:
    """The package of the GPT on ``gpus`` GPUs as pipelines of 2, and its plan.json."""
    assert cli.main(["split", str(GPT), "--gpus", str(gpus), "--pp", "2", "--dp-mode", mode,
                     "--schedule", schedule, "--out", str(out), "--force"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layout"]["dp"] == gpus // 2 and plan["layout"]["dp_mode"] == mode
    return plan


def _global_batch(path: Path, rows: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    batch = {"args": (torch.randint(0, 1000, (rows, 64), generator=generator),),
             "target": torch.randint(0, 1000, (rows, 64), generator=generator)}
    torch.save(batch, path)
    return batch


def _unsplit_grads(batch: dict[str, Any], clip: float | None) -> dict[str, torch.Tensor]:
    source, _ = load(str(GPT))
    model = source.model
    model.zero_grad(set_to_none=True)
    source.loss_fn(model(*batch["args"]), batch["target"]).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def _run(tmp_path: Path, mode: str, *flags: str, schedule: str = "1f1b", gpus: int = 4
         ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """Split, train one step under torchrun with ``flags``: (plan, batch, each rank's save)."""
    plan = _split(tmp_path / "pkg", mode, schedule, gpus)
    batch = _global_batch(tmp_path / "batch.pt", plan["layout"]["global_batch"])
    result = torchrun(gpus, tmp_path / "pkg" / "train_torchrun.py", "--model", str(GPT),
                      "--batch", str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"),
                      *flags)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    saves = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False)
             for r in range(gpus)]
    return plan, batch, saves


def _assert_model_grads(saves: list[dict[str, Any]], expected: dict[str, torch.Tensor]
                        ) -> None:
    """Every rank's whole gradients are the unsplit model's (float32: 1e-5 of the largest),
    and between them the ranks hold every parameter."""
    largest = max(float(g.abs().max()) for g in expected.values())
    seen = set()
    for rank, save in enumerate(saves):
        for name, grad in save["grads"].items():
            seen.add(name)
            error = float((grad - expected[name]).abs().max())
            assert error <= 1e-5 * largest, (rank, name, error, largest)
    assert seen == set(expected)


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_a_layout_step_gives_the_models_gradients_and_the_plans_memory(
        tmp_path: Path, mode: str) -> None:
    """2 x 2 ranks, Adam: the unsplit model's gradients on the global batch, the loss its
    loss on every last-stage rank, and per rank the plan's params, grads and optimizer
    bytes (fsdp: the Adam state of 1/d of the stage, parameters and gradients 1/d of it
    between steps, whole in the step, as torch's PipelineStage holds them)."""
    plan, batch, saves = _run(tmp_path, mode, "--optimizer", "adam")
    _assert_model_grads(saves, _unsplit_grads(batch, None))
    source, _ = load(str(GPT))
    with torch.no_grad():
        loss = float(source.loss_fn(source.model(*batch["args"]), batch["target"]))
    pp, dp = plan["layout"]["pp"], plan["layout"]["dp"]
    for rank, save in enumerate(saves):
        stage = plan["stages"][rank % pp]["memory"]
        held = save["memory"]
        assert {k: held[k] for k in ("params", "grads", "optimizer")} == {
            k: stage[k] for k in ("params", "grads", "optimizer")}, (rank, held, stage)
        shards = dp if mode == "fsdp" else 1
        assert held["params_local"] == held["params"] // shards, (rank, held)
        assert held["grads_local"] == held["grads"] // shards, (rank, held)
        if rank % pp == pp - 1:
            assert abs(float(save["loss"]) - loss) <= 1e-5 * loss, (rank, save["loss"], loss)


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_a_layout_step_clips_the_whole_models_gradient_norm(tmp_path: Path, mode: str) -> None:
    """--clip-grad-norm over every stage, every shard and the tied weight once: the
    unsplit model's gradients after torch's clip_grad_norm_."""
    _, batch, saves = _run(tmp_path, mode, "--clip-grad-norm", str(CLIP))
    _assert_model_grads(saves, _unsplit_grads(batch, CLIP))


def test_a_layout_refuses_another_world_size(tmp_path: Path) -> None:
    """The package of 2 x 2 ranks launched on 2: one line with the count to launch."""
    _split(tmp_path / "pkg", "fsdp")
    result = torchrun(2, tmp_path / "pkg" / "train_torchrun.py", "--model", str(GPT))
    output = (result.stdout + result.stderr).splitlines()
    assert result.returncode != 0
    assert not any(line.startswith("[rank") for line in output), output  # a rank's traceback
    why = ("world size (2) must equal the number of GPUs of the plan's layout (2 "
           "data-parallel pipelines of 2 GPUs, 4 in all): launch with torchrun "
           "--nproc-per-node 4")
    assert sorted(line for line in output if line.startswith("train_torchrun: error:")) == [
        f"train_torchrun: error: rank {rank}: {why}" for rank in (0, 1)]
