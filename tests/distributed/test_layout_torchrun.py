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

from . import gpt64
from ._helpers import (
    EXAMPLES,
    assert_model_grads,
    contiguous_plan,
    import_package,
    load,
    mini_batch,
    torchrun,
    write_package,
)

GPT = EXAMPLES / "gpt.py"
GPT64 = Path(gpt64.__file__)  # the same GPT in float64
CLIP = 0.5  # below the step's gradient norm (0.67 on this batch): clipping scales
# the gradients' error allowed, relative to the largest: float32's and float64's
TOLERANCE = {GPT: 1e-5, GPT64: 1e-12}


def _split(out: Path, mode: str, model: Path = GPT, gpus: int = 4, schedule: str = "1f1b"
           ) -> dict[str, Any]:
    """The package of ``model`` on ``gpus`` GPUs as pipelines of 2, and its plan.json."""
    assert cli.main(["split", str(model), "--gpus", str(gpus), "--pp", "2", "--dp-mode", mode,
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


def _unsplit(model: Path, batch: dict[str, Any], clip: float | None
             ) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsplit model's loss on ``batch`` and its gradients (clipped to ``clip``)."""
    source, _ = load(str(model))
    model = source.model
    model.zero_grad(set_to_none=True)
    loss = source.loss_fn(model(*batch["args"]), batch["target"])
    loss.backward()
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        assert norm > clip, (norm, clip)  # clipping scales
    return float(loss.detach()), {n: p.grad
                                  for n, p in model.named_parameters(remove_duplicate=False)}


def _run(tmp_path: Path, mode: str, *flags: str, model: Path = GPT, gpus: int = 4,
         schedule: str = "1f1b") -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """Split, train one step under torchrun with ``flags``: (plan, batch, each rank's save)."""
    plan = _split(tmp_path / "pkg", mode, model, gpus, schedule)
    batch = _global_batch(tmp_path / "batch.pt", plan["layout"]["global_batch"])
    result = torchrun(gpus, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model),
                      "--batch", str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"),
                      *flags)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    saves = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False)
             for r in range(gpus)]
    return plan, batch, saves


@pytest.mark.parametrize(("model", "mode"), [(GPT, "fsdp"), (GPT, "ddp"), (GPT64, "fsdp")],
                         ids=["fsdp", "ddp", "fsdp-float64"])
def test_a_layout_step_gives_the_models_gradients_and_the_plans_memory(
        tmp_path: Path, model: Path, mode: str) -> None:
    """2 x 2 ranks, Adam: the unsplit model's gradients on the global batch, the loss its
    loss on every last-stage rank, and per rank the plan's params, grads and optimizer
    bytes (fsdp: the Adam state of 1/d of the stage, parameters and gradients 1/d of it
    between steps and whole inside the step, where torch's PipelineStage keeps FSDP2 from
    resharding them until the last micro-batch's backward)."""
    plan, batch, saves = _run(tmp_path, mode, "--optimizer", "adam", model=model)
    loss, expected = _unsplit(model, batch, None)
    assert_model_grads(saves, expected, TOLERANCE[model])
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
            assert abs(float(save["loss"]) - loss) <= TOLERANCE[model] * loss, (rank, loss)


@pytest.mark.parametrize(("mode", "schedule"), [("fsdp", "1f1b"), ("ddp", "1f1b"),
                                               ("fsdp", "zb1p")])
def test_a_layout_step_clips_the_whole_models_gradient_norm(tmp_path: Path, mode: str,
                                                            schedule: str) -> None:
    """--clip-grad-norm over every stage, every shard and the tied weight once: the
    unsplit model's gradients after torch's clip_grad_norm_ (zb1p: torch's zero-bubble
    class, whose weight pass FSDP2's sync follows)."""
    _, batch, saves = _run(tmp_path, mode, "--clip-grad-norm", str(CLIP), schedule=schedule)
    assert_model_grads(saves, _unsplit(GPT, batch, CLIP)[1], TOLERANCE[GPT])


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


@pytest.mark.parametrize("replicas", [(2, 2), (1, 2)], ids=["lanes", "uneven"])
def test_replicated_stages_clip_the_whole_models_norm(tmp_path: Path,
                                                       replicas: tuple[int, ...]) -> None:
    """PipeDream's "2-2" (every stage replicated twice: two lanes of whole pipelines, each
    taking its rows of every micro-batch) runs on a (pp, dp) mesh whose copies DDP keeps
    equal, as a layout's do; "1-2" on the schedule table, its replicas summed by grads.py.
    Clipped, both give the unsplit model's gradients (the table's step ignored the clip)."""
    source, traced = load(str(GPT))
    write_package(tmp_path / "pkg", traced, contiguous_plan(
        traced.gm.graph, 2, schedule="1f1b", microbatches=2, replicas=replicas))
    batch = {"args": mini_batch(source.args), "target": mini_batch(source.target)}
    torch.save(batch, tmp_path / "batch.pt")
    ranks = sum(replicas)
    result = torchrun(ranks, tmp_path / "pkg" / "train_torchrun.py", "--model", str(GPT),
                      "--batch", str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"),
                      "--clip-grad-norm", "0.1")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    saves = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False)
             for r in range(ranks)]
    assert_model_grads(saves, _unsplit(GPT, batch, 0.1)[1], TOLERANCE[GPT])


def test_ddp_under_a_schedule_that_splits_the_backward_is_refused(tmp_path: Path) -> None:
    """DDP's reducer never sees the gradients of zb1p's weight pass: each pipeline kept its
    own (stage 1 up to 89 % off); the schedule is refused in one line instead, when
    planned (fxpipe split) and when a package planned for 1f1b is asked to run it."""
    code = cli.main(["split", str(GPT), "--gpus", "4", "--pp", "2", "--dp-mode", "ddp",
                     "--schedule", "zb1p", "--out", str(tmp_path / "refused")])
    assert code == 2 and not (tmp_path / "refused").exists()
    _split(tmp_path / "pkg", "ddp", schedule="1f1b")
    distributed = import_package(tmp_path / "pkg", "layout_ddp_zb1p").distributed
    with pytest.raises(ValueError, match=r"^torch's DDP does not average the gradients that "
                       r"zb1p's weight pass computes apart from the backward; split again "
                       r"with --dp-mode fsdp, or run schedule 1f1b or gpipe$"):
        distributed.build_schedule([], None, schedule="zb1p")
