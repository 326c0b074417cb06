"""Transparency across processes: the generated package's train_torchrun.py under a
real ``torchrun --nproc-per-node K`` (gloo, CPU) gives the loss and the gradients of
the single-process runner and of the unsplit model. Each rank builds the model on
meta, materializes only its stage and loads it from the checkpoint file."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ._helpers import EXAMPLES, contiguous_plan, import_package, load, mini_batch, torchrun
from ._helpers import write_package as write

_names = itertools.count()

# (example, stages, schedule): GPT's tok_emb/lm_head weight is tied across the cut;
# the U-Net's encoder-to-decoder skips cross it (with 3 stages a skip passes through
# the middle stage).
CASES = [("gpt", 2, "1f1b"), ("unet", 2, "gpipe")]


@pytest.mark.parametrize(("name", "k", "schedule"), CASES)
def test_torchrun_matches_runner_and_model(tmp_path: Path, name: str, k: int,
                                           schedule: str) -> None:
    model_file = EXAMPLES / f"{name}.py"
    source, traced = load(str(model_file))
    plan = contiguous_plan(traced.gm.graph, k, schedule=schedule, microbatches=2)
    files = write(tmp_path / "pkg", traced, plan)
    model = source.model
    torch.save(model.state_dict(), tmp_path / "model.pt")
    args, kwargs, target = mini_batch(source.args), mini_batch(source.kwargs), mini_batch(
        source.target)
    torch.save({"args": args, "kwargs": kwargs, "target": target}, tmp_path / "batch.pt")
    if name == "gpt":
        assert '{0: "tok_emb.weight", 1: "lm_head.weight"}' in files["distributed.py"]

    result = torchrun(k, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model_file),
                      "--checkpoint", str(tmp_path / "model.pt"), "--batch",
                      str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"), "--lr", "0")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt") for r in range(k)]

    # the single-process runner of the same package
    package = import_package(tmp_path / "pkg", f"fxpipe_dist_{next(_names)}")
    runner = package.PipelineRunner(package.build_stages(model))
    model.zero_grad(set_to_none=True)
    runner_loss = runner.step(kwargs if kwargs else args, target, source.loss_fn)
    runner_grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    # the unsplit model
    model.zero_grad(set_to_none=True)
    model_loss = source.loss_fn(model(*args, **kwargs), target)
    model_loss.backward()
    model_grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    model.zero_grad(set_to_none=True)

    loss = ranks[-1]["loss"]
    assert all(r["loss"] is None for r in ranks[:-1])
    close = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(loss, model_loss.detach(), **close)
    torch.testing.assert_close(loss, torch.as_tensor(runner_loss), **close)
    seen = set()
    for r, saved in enumerate(ranks):
        assert saved["grads"], f"rank {r} saved no gradients"
        for key, grad in saved["grads"].items():
            seen.add(key)
            torch.testing.assert_close(grad, model_grads[key], **close,
                                       msg=lambda m, key=key, r=r: f"rank {r} {key}: {m}")
            torch.testing.assert_close(grad, runner_grads[key], **close,
                                       msg=lambda m, key=key, r=r: f"rank {r} {key}: {m}")
    assert seen == set(model_grads)  # every parameter lives on some rank
