"""Layouts of 4 and 8 ranks under torchrun, every schedule placement, three models: issue
50's matrix. 2 x 2, 2 x 4 and 4 x 2 ranks (pp x dp), FSDP2 and DDP, schedules 1f1b (one
stage per rank), interleaved (two, stage j on rank j % pp) and zbv (two in a V, stage j
and 2 pp - 1 - j on rank j), on the tied-embedding GPT, an HF Llama and an HF T5 (traced
by torch.export; its embedding shared by encoder, decoder and LM head): after one Adam
step every parameter's gradient is the unsplit model's on the same global batch, and
every rank holds the bytes of parameters, gradients and optimizer state that plan.json
says for its stages; clipped, the unsplit model's clipped step. DDP under zbv is refused
(test_layout_torchrun.py).

The default suite keeps one run of each new path: 8 ranks, two sharded stages a rank
(GPT, pp 4 x dp 2, fsdp, interleaved), and an HF model under a V whose first rank holds
two copies of a tied weight (T5, 2 x 2, zbv, clipped); the rest is slow."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fxpipe.plan import Layout

from ._helpers import contiguous_plan, load, torchrun, write_package
from .layout import GPT, GPT64, LLAMA, T5, Model, assert_plan_memory, assert_unsplit, run

# (gpus, pp), the layouts of the issue
LAYOUTS = {"2x2": (4, 2), "2x4": (8, 2), "4x2": (8, 4)}
MODELS = {"gpt": GPT, "gpt64": GPT64, "llama": LLAMA, "t5": T5}
FAST = {("gpt", "4x2", "fsdp", "interleaved")}
# (mode, schedule): DDP under zbv is refused, its weight pass unseen by DDP's reducer
RUNS = [("fsdp", "1f1b"), ("ddp", "1f1b"), ("fsdp", "interleaved"), ("ddp", "interleaved"),
        ("fsdp", "zbv")]


def _cases() -> list:
    """Every layout, mode and schedule: on the GPT (but 2 x 2 1f1b, test_layout_torchrun.py's)
    and on both HF models."""
    cases = [("gpt", layout, mode, schedule) for layout in LAYOUTS for mode, schedule in RUNS
             if (layout, schedule) != ("2x2", "1f1b")]  # test_layout_torchrun.py's
    cases += [(model, layout, mode, schedule) for model in ("llama", "t5")
              for layout in LAYOUTS for mode, schedule in RUNS]
    return [pytest.param(*case, marks=() if case in FAST else (pytest.mark.slow,),
                         id="-".join(case)) for case in cases]


def _step(tmp_path: Path, model: Model, layout: str, mode: str, schedule: str,
          *flags: str) -> tuple[dict, dict, list]:
    gpus, pp = LAYOUTS[layout]
    return run(tmp_path, model, mode, *flags, gpus=gpus, pp=pp, schedule=schedule)


@pytest.mark.parametrize(("model", "layout", "mode", "schedule"), _cases())
def test_a_layout_step_is_the_unsplit_models(tmp_path: Path, model: str, layout: str,
                                             mode: str, schedule: str) -> None:
    """One Adam step: the unsplit model's gradients (float32 GPT: 1e-5 of the largest;
    the float64 HF models: 1e-12), every parameter on some rank, and the plan's bytes
    on each rank, summed over its stages (its local shards between steps)."""
    plan, batch, saves = _step(tmp_path, MODELS[model], layout, mode, schedule,
                               "--optimizer", "adam")
    assert_unsplit(saves, MODELS[model], batch)
    assert_plan_memory(tmp_path / "pkg", plan, saves)


CLIPPED = [("gpt64", "2x2", "fsdp", "interleaved"), ("gpt64", "2x2", "ddp", "interleaved"),
           ("gpt64", "2x2", "fsdp", "zbv"), ("gpt64", "4x2", "ddp", "1f1b"),
           ("llama", "2x4", "fsdp", "1f1b"), ("t5", "2x2", "fsdp", "zbv")]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout", "mode", "schedule"), CLIPPED,
                         ids=["-".join(case) for case in CLIPPED])
def test_a_clipped_layout_step_is_the_unsplit_models_clipped_step(
        tmp_path: Path, model: str, layout: str, mode: str, schedule: str) -> None:
    """--clip-grad-norm 0.01 (below every model's norm here: clipping scales) over every
    stage, shard and tied copy once: torch's clip_grad_norm_ of the unsplit model."""
    _, batch, saves = _step(tmp_path, MODELS[model], layout, mode, schedule,
                            "--clip-grad-norm", "0.01")
    assert_unsplit(saves, MODELS[model], batch, 0.01)


def test_a_v_layout_adds_the_tied_copies_one_rank_holds(tmp_path: Path) -> None:
    """T5 cut by hand into 4 stages in a V on 2 x 2 ranks, fsdp: its shared embedding is
    read by stage 0 (the encoder's), stage 1 (the decoder's) and stage 3 (the LM head),
    so rank 0 holds two copies, each sharded by its own stage's FSDP2; the rank adds
    them before the pipeline's sum, and the clipped step (the tied weight counted once)
    is the unsplit model's (each copy alone had its stage's share only)."""
    _, traced = load(T5.spec)
    plan = contiguous_plan(traced.gm.graph, 4, schedule="zbv", microbatches=4,
                           virtual_stages=2)
    plan = replace(plan, layout=Layout(
        gpus=4, gpus_per_node=4, pp=2, dp=2, dp_mode="fsdp", global_batch=16,
        microbatch_size=2, microbatches=4, pipeline_link="intra", sync_link="intra",
        sync_s=0.0, step_s=0.0, proved=True))
    write_package(tmp_path / "pkg", traced, plan)
    distributed = (tmp_path / "pkg" / "distributed.py").read_text()
    assert '{0: "lm_head.weight", 1: "lm_head.weight", 3: "lm_head.weight"}' in distributed
    batch = T5.batch(16)
    torch.save(batch, tmp_path / "batch.pt")
    result = torchrun(4, tmp_path / "pkg" / "train_torchrun.py", "--model", T5.spec,
                      "--batch", str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"),
                      "--clip-grad-norm", "0.01")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    saves = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False)
             for r in range(4)]
    assert_unsplit(saves, T5, batch, 0.01)
