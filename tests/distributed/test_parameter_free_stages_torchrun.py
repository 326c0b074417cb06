"""Stages that hold no parameters ahead of the embedding, under torchrun.

A plan may put only parameter-free ops (the sequence length, an ``arange`` of
positions) in the first stages, so the stage holding the embedding receives nothing but
integers. torch's split backward (zb1p, zbv, dualpipev) finds a weight's gradient only
where the weight's path meets a received tensor that needs a gradient: such a stage's
weights got none, the loss looking right (runtime/torch_zero_bubble.py, point 3). Every schedule, on
the tied-embedding GPT cut so, must leave every parameter the unsplit model's gradient.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ._helpers import EXAMPLES, contiguous_plan, load, torchrun
from ._helpers import write_package as write

M = 4

# schedule -> (stages, ranks, the ops each stage starts at: stages 0 and 1 hold the
# GPT's size, getattr and arange, so the embedding's stage receives only integers)
CASES = {
    "zb1p": (2, 2, (0, 3)),
    "zbv": (4, 2, (0, 1, 3, 60)),
    "dualpipev": (4, 2, (0, 1, 3, 60)),
    "1f1b": (2, 2, (0, 3)),
    "interleaved": (4, 2, (0, 1, 3, 60)),
}
SLOW = {"1f1b", "interleaved"}  # a whole backward per action: nothing to lose in a split


@pytest.mark.parametrize("schedule", [
    pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in CASES])
def test_every_parameter_gets_its_gradient(tmp_path: Path, schedule: str) -> None:
    k, ranks, starts = CASES[schedule]
    model_file = EXAMPLES / "gpt.py"
    source, traced = load(str(model_file))
    plan = contiguous_plan(traced.gm.graph, k, schedule=schedule, microbatches=M,
                           starts=starts)
    if k > ranks:
        plan = dataclasses.replace(plan, virtual_stages=k // ranks)
    write(tmp_path / "pkg", traced, plan)
    model = source.model
    assert not any(p for name in plan.stages[0].nodes
                   for p in _parameters(traced.gm, name)), "stage 0 must hold no parameter"
    torch.save(model.state_dict(), tmp_path / "model.pt")
    args = tuple(torch.cat([a, a.flip(0), a.flip(-1), a.flip(0).flip(-1)]) for a in source.args)
    target = torch.cat([source.target, source.target.flip(0), source.target.flip(-1),
                        source.target.flip(0).flip(-1)])
    torch.save({"args": args, "kwargs": {}, "target": target}, tmp_path / "batch.pt")

    result = torchrun(ranks, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model_file),
                      "--checkpoint", str(tmp_path / "model.pt"), "--batch",
                      str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"), "--lr", "0")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]

    model.zero_grad(set_to_none=True)
    source.loss_fn(model(*args), target).backward()
    want = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    got: dict[str, torch.Tensor] = {}
    for rank in range(ranks):
        got.update(torch.load(tmp_path / "out" / f"rank{rank}.pt")["grads"])
    named = dict(model.named_parameters(remove_duplicate=False))
    assert {id(named[key]) for key in got} == {id(p) for p in model.parameters()}
    for key, grad in got.items():
        assert grad is not None, f"{key} got no gradient"
        torch.testing.assert_close(grad, want[key], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")


def _parameters(gm: torch.fx.GraphModule, name: str) -> list[torch.Tensor]:
    node = next(n for n in gm.graph.nodes if n.name == name)
    if node.op == "call_module":
        return list(gm.get_submodule(str(node.target)).parameters())
    return []
