"""Transparency across processes: the generated package's train_torchrun.py under a
real ``torchrun --nproc-per-node K`` (gloo, CPU) gives the loss and the gradients of
the single-process runner and of the unsplit model. Each rank builds the model on
meta, materializes only its stage and loads it from the checkpoint file."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe.schedules import kind_of

from . import shared_inputs_lm
from ._helpers import EXAMPLES, contiguous_plan, import_package, load, mini_batch, torchrun
from ._helpers import write_package as write

_names = itertools.count()

# (example, schedule, replicas per stage): GPT's tok_emb/lm_head weight is tied across
# the cut; the U-Net's encoder-to-decoder skips cross it (with 3 stages a skip passes
# through the middle stage). "2-2": two PipelineStage lanes of two ranks, each lane
# taking half of every micro-batch, gradients averaged over each stage's replicas (the
# tied weight over all four of its copies). "1-2" and "1-2-1": uneven replicas on the
# schedule table, one rank sending each replica its rows (and the U-Net's skips whole
# rows through the replicated middle stage). "interleaved": 4 stages on 2 ranks (rank 0
# runs stages 0 and 2), torch's ScheduleInterleaved1F1B; the GPT's tied weight is on
# ranks 0 and 1, the U-Net's skips go from rank 0 through rank 1 back to rank 0. Two
# stages on one rank: the tied weight's two copies there become one. The last field:
# stages 0 and 2 recompute (their forward runs again in the backward), in full (True) or
# selectively: "selective:256:128" keeps the outputs of the matmuls doing more than 256
# FLOPs per element, or 256 into at most 128 columns (the GPT's fc2 and attention output
# projection), and runs its q, k, v, fc1 and attention matmuls again.
# Each case costs a torchrun (10-25 s of a 2-core machine); the two marked slow are each
# another case with less in it: GPT 1f1b on two ranks is "1-2" without the replica and
# the recompute (and runs in test_precision_torchrun.py and test_report_card_torchrun.py),
# interleaved on one rank is "interleaved" on fewer ranks.
CASES = [
    pytest.param("gpt", "1f1b", (1, 1), False, marks=pytest.mark.slow),
    ("unet", "gpipe", (1, 1), False),
    ("gpt", "1f1b", (2, 2), "selective:256:128"),
    ("gpt", "1f1b", (1, 2), True),
    ("unet", "1f1b", (1, 2, 1), False),
    ("gpt", "interleaved", (1, 1, 1, 1), False),
    ("unet", "interleaved", (1, 1, 1, 1), True),
    pytest.param("gpt", "interleaved", (1, 1), False, marks=pytest.mark.slow),
    # Hugging Face models (torch.export): GPT-2's output is a dict, rebuilt from the last
    # stage's tensors for the loss; T5 sends transposed (non-contiguous) values
    ("hf_gpt2", "interleaved", (1, 1, 1, 1), False),
    ("hf_t5", "1f1b", (1, 1), False),
]


@pytest.mark.parametrize(("name", "schedule", "replicas", "recompute"), CASES)
def test_torchrun_matches_runner_and_model(tmp_path: Path, name: str, schedule: str,
                                           replicas: tuple[int, ...],
                                           recompute: bool | str) -> None:
    model_file = EXAMPLES / f"{name}.py"
    source, traced = load(str(model_file))
    v = 2 if schedule == "interleaved" else 1
    k, n = len(replicas), sum(replicas) // v
    plan = contiguous_plan(traced.gm.graph, k, schedule=schedule, microbatches=2,
                           replicas=replicas, virtual_stages=v,
                           recompute=tuple(recompute if j % 2 == 0 else False
                                           for j in range(k)))
    files = write(tmp_path / "pkg", traced, plan)
    model = source.model
    torch.save(model.state_dict(), tmp_path / "model.pt")
    args, kwargs, target = mini_batch(source.args), mini_batch(source.kwargs), mini_batch(
        source.target)
    torch.save({"args": args, "kwargs": kwargs, "target": target}, tmp_path / "batch.pt")
    if name == "gpt":
        head = k - 1  # the LM head's stage
        assert f'{{0: "tok_emb.weight", {head}: "lm_head.weight"}}' in files["distributed.py"]

    assert f"torchrun --nproc-per-node {n} train_torchrun.py" in files["train_torchrun.py"]
    if isinstance(recompute, str):  # the ranks' adapters recompute by the runner's modes
        assert f'"{recompute}"' in files["runner.py"]
    result = torchrun(n, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model_file),
                      "--checkpoint", str(tmp_path / "model.pt"), "--batch",
                      str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"), "--lr", "0")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    check_ranks(tmp_path, replicas, n, source.model, source.loss_fn, args, kwargs, target)


def check_ranks(tmp_path: Path, replicas: tuple[int, ...], n: int, model: torch.nn.Module,
                loss_fn: Any, args: Any, kwargs: Any, target: Any, *, runner: bool = True
                ) -> None:
    """The loss and gradients the n ranks saved under ``tmp_path / "out"`` equal those of
    the package's single-process runner (unless not ``runner``) and of the unsplit model
    on the same mini-batch."""
    ranks = [torch.load(tmp_path / "out" / f"rank{rank}.pt") for rank in range(n)]

    # the single-process runner of the same package
    package = import_package(tmp_path / "pkg", f"fxpipe_dist_{next(_names)}")
    one_process = package.PipelineRunner(package.build_stages(model))
    assert one_process.replicas == list(replicas)
    runner_loss, runner_grads = None, {}
    if runner:
        model.zero_grad(set_to_none=True)
        runner_loss = one_process.step(kwargs if kwargs else args, target, loss_fn)
        runner_grads = {n: p.grad.clone()
                        for n, p in model.named_parameters(remove_duplicate=False)}
    # the unsplit model
    model.zero_grad(set_to_none=True)
    model_loss = loss_fn(model(*args, **kwargs), target)
    model_loss.backward()
    model_grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    model.zero_grad(set_to_none=True)

    # the last stage's r ranks (the last ones; rank 0 in a V): the same loss, over the
    # whole micro-batches; no other rank has one
    holders = list(package.distributed.PIPELINE.ranks_of(len(replicas) - 1))
    v_placed = kind_of(package.PLAN["schedule"]).spec.v_placed
    assert holders == ([0] if v_placed else list(range(n - replicas[-1], n)))
    assert [rank for rank, saved in enumerate(ranks) if saved["loss"] is not None] == holders
    last = [ranks[rank] for rank in holders]
    loss = last[0]["loss"]
    for saved in last[1:]:
        torch.testing.assert_close(saved["loss"], loss, rtol=0, atol=0)
    close = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(loss, model_loss.detach(), **close)
    if runner:
        torch.testing.assert_close(loss, torch.as_tensor(runner_loss), **close)
    seen = set()
    for rank, saved in enumerate(ranks):
        assert saved["grads"], f"rank {rank} saved no gradients"
        for key, grad in saved["grads"].items():
            seen.add(key)
            torch.testing.assert_close(grad, model_grads[key], **close,
                                       msg=lambda m, key=key, rank=rank: f"rank {rank} {key}: {m}")
            if runner:
                torch.testing.assert_close(
                    grad, runner_grads[key], **close,
                    msg=lambda m, key=key, rank=rank: f"rank {rank} {key}: {m}")
    # every parameter lives on some rank (under one of its names, when tied)
    named = dict(model.named_parameters(remove_duplicate=False))
    assert {id(named[key]) for key in seen} == {id(p) for p in model.parameters()}


# (schedule, replicas per stage, mini-batch) for a model with a (T, T) causal mask and
# (1, T) position_ids that every sample shares. "file": distinct samples from --batch;
# "example": train_torchrun.py's own mini-batch (the example micro-batch M times, the
# shared inputs once). "2-2": each lane takes its rows of every micro-batch and all of
# the shared inputs; "1-2": the schedule table sends the mask whole to both replicas;
# zbv: torch's zero-bubble class over 4 stages in a V on 2 ranks.
SHARED_CASES = [
    ("1f1b", (1, 1), "file"),
    pytest.param("1f1b", (1, 1), "example", marks=pytest.mark.slow),
    pytest.param("gpipe", (2, 2), "file", marks=pytest.mark.slow),
    pytest.param("1f1b", (1, 2), "file", marks=pytest.mark.slow),
    pytest.param("interleaved", (1, 1, 1, 1), "file", marks=pytest.mark.slow),
    pytest.param("zbv", (1, 1, 1, 1), "file", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("schedule", "replicas", "batch"), SHARED_CASES)
def test_torchrun_hands_shared_inputs_whole_to_every_micro_batch(
        tmp_path: Path, schedule: str, replicas: tuple[int, ...], batch: str) -> None:
    model_file = Path(shared_inputs_lm.__file__)
    source, traced = load(str(model_file))
    assert traced.shared_inputs == ("mask", "position_ids")
    v = 2 if schedule in ("interleaved", "zbv") else 1
    k, n = len(replicas), sum(replicas) // v
    plan = contiguous_plan(traced.gm.graph, k, schedule=schedule, microbatches=shared_inputs_lm.M,
                           replicas=replicas, virtual_stages=v,
                           shared_inputs=traced.shared_inputs)
    files = write(tmp_path / "pkg", traced, plan)
    assert 'SHARED_INPUTS = ("mask", "position_ids")' in files["runner.py"]
    assert all("mask" in wire for wire in files_wires(tmp_path / "pkg"))  # every stage reads it
    torch.save(source.model.state_dict(), tmp_path / "model.pt")
    rows = shared_inputs_lm.M * shared_inputs_lm.B
    assert rows == shared_inputs_lm.T  # the mask's dim 0 is the mini-batch's
    if batch == "file":
        args, target = shared_inputs_lm.mini_batch(rows)
        torch.save({"args": args, "kwargs": {}, "target": target}, tmp_path / "batch.pt")
        given = ["--batch", str(tmp_path / "batch.pt")]
    else:
        ids, mask, positions = source.args
        args, target = (torch.cat([ids] * shared_inputs_lm.M), mask, positions), torch.cat(
            [source.target] * shared_inputs_lm.M)
        given = []
    result = torchrun(n, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model_file),
                      "--checkpoint", str(tmp_path / "model.pt"), *given,
                      "--save", str(tmp_path / "out"), "--lr", "0")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    check_ranks(tmp_path, replicas, n, source.model, source.loss_fn, args, {}, target)


def files_wires(directory: Path) -> tuple[tuple[str, ...], ...]:
    """WIRES of the generated distributed.py in ``directory``."""
    package = import_package(directory, f"fxpipe_dist_{next(_names)}")
    return package.distributed.WIRES


def test_torchrun_refuses_another_shape_in_one_line(tmp_path: Path) -> None:
    """torch's PipelineStage sends and receives at the shapes the stages were built with:
    a mini-batch of half the sequence length stops every rank with one line naming both
    shapes, before any of them builds its stage (no rank dies on another's closed
    connection)."""
    model_file = EXAMPLES / "gpt.py"
    source, traced = load(str(model_file))
    write(tmp_path / "pkg", traced, contiguous_plan(traced.gm.graph, 2, microbatches=2))
    (ids,), target = mini_batch(source.args), mini_batch(source.target)
    half = ids.size(1) // 2
    torch.save({"args": (ids[:, :half],), "kwargs": {}, "target": target[:, :half]},
               tmp_path / "batch.pt")
    result = torchrun(2, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model_file),
                      "--batch", str(tmp_path / "batch.pt"))
    assert result.returncode != 0
    output = (result.stdout + result.stderr).splitlines()
    errors = sorted(line for line in output if line.startswith("train_torchrun: error:"))
    why = ("graph input 'idx' has shape (4, 32), but under torchrun the stages were built for "
           "2 micro-batches of shape (2, 64), (4, 64) in all: torch.distributed.pipelining "
           "fixes the shapes stages send and receive when pipeline_stage builds them; build "
           "the stages again with an example micro-batch of the new shape, or pad the batch to "
           "the built one (the single-process PipelineRunner takes any shape the model takes)")
    assert errors == [f"train_torchrun: error: rank {rank}: {why}" for rank in (0, 1)], output
    assert not any(line.startswith("[rank") for line in output), output  # a rank's traceback
