"""A plan's layout under torchrun: ``fxpipe split examples/gpt.py --gpus 4 --pp 2
--dp-mode fsdp|ddp`` plans 2 pipelines of 2 stages, and its train_torchrun.py runs them on
torch's own (dp, pp) DeviceMesh, each stage sharded by FSDP2 or replicated by DDP over
its dp sub-mesh. On the GPT (its embedding tied to its LM head across the cut), one step
on the global batch gives every parameter the unsplit model's gradient, clipped as
torch's ``clip_grad_norm_`` clips the unsplit model's, and every rank holds the bytes of
parameters, gradients and Adam state that plan.json says for its stage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxpipe import cli

from ._helpers import contiguous_plan, import_package, load, mini_batch, torchrun, write_package
from .layout import GPT, GPT64, Model, assert_plan_memory, assert_unsplit, run, split

CLIP = 0.5  # below the step's gradient norm (0.67 on this batch): clipping scales


@pytest.mark.parametrize(("model", "mode"), [(GPT, "fsdp"), (GPT, "ddp"), (GPT64, "fsdp")],
                         ids=["fsdp", "ddp", "fsdp-float64"])
def test_a_layout_step_gives_the_models_gradients_and_the_plans_memory(
        tmp_path: Path, model: Model, mode: str) -> None:
    """2 x 2 ranks, Adam: the unsplit model's gradients on the global batch, the loss its
    loss on every last-stage rank, and per rank the plan's params, grads and optimizer
    bytes (fsdp: the Adam state of 1/d of the stage, parameters and gradients 1/d of it
    between steps and whole inside the step, where torch's PipelineStage keeps FSDP2 from
    resharding them until the last micro-batch's backward)."""
    plan, batch, saves = run(tmp_path, model, mode, "--optimizer", "adam")
    loss = assert_unsplit(saves, model, batch)
    assert_plan_memory(tmp_path / "pkg", plan, saves)
    pp = plan["layout"]["pp"]
    for rank, save in enumerate(saves):
        if rank % pp == pp - 1:
            assert abs(float(save["loss"]) - loss) <= model.tolerance * loss, (rank, loss)


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_pure_data_parallelism_is_a_layout_that_runs(tmp_path: Path, mode: str) -> None:
    """pp 1: one stage, the whole model, on each of 2 ranks (what ``--gpus 2`` alone chooses
    for a model this small): the unsplit model's gradients and the plan's bytes."""
    plan, batch, saves = run(tmp_path, GPT64, mode, "--optimizer", "adam", gpus=2, pp=1)
    assert plan["num_stages"] == 1
    assert_unsplit(saves, GPT64, batch)
    assert_plan_memory(tmp_path / "pkg", plan, saves)


@pytest.mark.parametrize(("mode", "schedule"), [("fsdp", "1f1b"), ("ddp", "1f1b"),
                                               ("fsdp", "zb1p")])
def test_a_layout_step_clips_the_whole_models_gradient_norm(tmp_path: Path, mode: str,
                                                            schedule: str) -> None:
    """--clip-grad-norm over every stage, every shard and the tied weight once: the
    unsplit model's gradients after torch's clip_grad_norm_ (zb1p: torch's zero-bubble
    class, whose weight pass FSDP2's sync follows)."""
    _, batch, saves = run(tmp_path, GPT, mode, "--clip-grad-norm", str(CLIP),
                          schedule=schedule)
    assert_unsplit(saves, GPT, batch, CLIP)


def test_a_layout_refuses_another_world_size(tmp_path: Path) -> None:
    """The package of 2 x 2 ranks launched on 2: one line with the count to launch."""
    split(tmp_path / "pkg", GPT, "fsdp")
    result = torchrun(2, tmp_path / "pkg" / "train_torchrun.py", "--model", GPT.spec)
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
    source, traced = load(GPT.spec)
    write_package(tmp_path / "pkg", traced, contiguous_plan(
        traced.gm.graph, 2, schedule="1f1b", microbatches=2, replicas=replicas))
    batch = {"args": mini_batch(source.args), "target": mini_batch(source.target)}
    torch.save(batch, tmp_path / "batch.pt")
    ranks = sum(replicas)
    result = torchrun(ranks, tmp_path / "pkg" / "train_torchrun.py", "--model", GPT.spec,
                      "--batch", str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"),
                      "--clip-grad-norm", "0.1")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    saves = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False)
             for r in range(ranks)]
    assert_unsplit(saves, GPT, batch, 0.1)


def test_ddp_under_a_schedule_that_splits_the_backward_is_refused(tmp_path: Path) -> None:
    """DDP's reducer never sees the gradients of zb1p's weight pass: each pipeline kept its
    own (stage 1 up to 89 % off). torch cannot: its weight pass (stage_backward_weight)
    writes ``.grad`` itself, past the AccumulateGrad hooks DDP's reducer listens on. The
    schedules that split the backward (zb1p, and zbv, the V's) are refused in one line
    instead, when planned (fxpipe split) and when a package planned for 1f1b is asked to
    run one."""
    for kind in ("zb1p", "zbv"):
        code = cli.main(["split", GPT.spec, "--gpus", "4", "--pp", "2", "--dp-mode", "ddp",
                         "--schedule", kind, "--out", str(tmp_path / "refused")])
        assert code == 2 and not (tmp_path / "refused").exists(), kind
    split(tmp_path / "pkg", GPT, "ddp")
    distributed = import_package(tmp_path / "pkg", "layout_ddp_zb1p").distributed
    with pytest.raises(ValueError, match=r"^torch's DDP does not average the gradients that "
                       r"zb1p's weight pass computes apart from the backward; split again "
                       r"with --dp-mode fsdp, or run schedule 1f1b or gpipe$"):
        distributed.build_schedule([], None, schedule="zb1p")
