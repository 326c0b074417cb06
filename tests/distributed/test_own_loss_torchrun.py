"""A model that computes its own loss (nanoGPT's ``model(X, Y)`` returning ``(logits,
loss)``, trained with ``loss_fn = lambda out, _: out[1]`` and no ``example_target()``)
trains under torchrun as it does in one process: the same loss and gradients as the
unsplit model. torch's schedules want a target per micro-batch and concatenate the
outputs along dim 0, which the 0-dim loss does not have (see runtime/own_loss.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from . import self_loss_lm
from ._helpers import contiguous_plan, load, torchrun, write_package
from .test_torchrun import check_ranks

M = 2  # micro-batches

# (replicas per stage, mini-batch): "example": train_torchrun.py's own mini-batch, the
# example micro-batch M times, with no example_target() in the file; "file": a --batch
# without a target, on uneven replicas (the schedule table, one rank per replica).
CASES = [((1, 1), "example"), ((1, 2), "file")]


@pytest.mark.parametrize(("replicas", "batch"), CASES)
def test_a_model_computing_its_own_loss_trains_under_torchrun(
        tmp_path: Path, replicas: tuple[int, ...], batch: str) -> None:
    model_file = Path(self_loss_lm.__file__)
    source, traced = load(str(model_file))
    assert source.target is None and not hasattr(self_loss_lm, "example_target")
    write_package(tmp_path / "pkg", traced, contiguous_plan(
        traced.gm.graph, 2, schedule="1f1b", microbatches=M, replicas=replicas))
    torch.save(source.model.state_dict(), tmp_path / "model.pt")
    if batch == "file":
        args = self_loss_lm.mini_batch(M * self_loss_lm.B, seed=2)
        torch.save({"args": args, "kwargs": {}}, tmp_path / "batch.pt")
        given = ["--batch", str(tmp_path / "batch.pt")]
    else:
        args, given = tuple(torch.cat([x] * M) for x in source.args), []
    result = torchrun(sum(replicas), tmp_path / "pkg" / "train_torchrun.py", "--model",
                      str(model_file), "--checkpoint", str(tmp_path / "model.pt"), *given,
                      "--save", str(tmp_path / "out"), "--lr", "0")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    # the runner takes a replicated stage's 0-dim output from replica 0 (runtime/replicas.py),
    # so the loss of a model computing its own is compared with it only unreplicated
    check_ranks(tmp_path, replicas, sum(replicas), source.model, source.loss_fn, args, {},
                None, runner=max(replicas) == 1)
