"""fxpipe.runtime.torch_zero_bubble: the zero-bubble schedules on torch's classes, and the stage
boundary their split backward needs (StageAdapter.split_backward)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from fxpipe.runtime.adapter import StageAdapter
from fxpipe.runtime.torch_zero_bubble import ZERO_BUBBLE, requirement, zero_bubble_schedule
from fxpipe.schedules import KINDS


def test_the_torch_classes_are_the_kinds() -> None:
    kinds = {kind.value: spec.torch_class for kind, spec in KINDS.items()
             if spec.splits_backward}
    assert kinds == ZERO_BUBBLE


@pytest.mark.parametrize(("kind", "k", "n", "m", "met"), [
    ("zb1p", 2, 2, 4, True),
    ("zb1p", 2, 2, 3, True),    # one round of 3
    ("zb1p", 4, 4, 10, True),   # two rounds of 5
    ("zb1p", 2, 2, 5, False),   # two rounds of 2.5
    ("zb1p", 4, 2, 4, False),   # two stages per rank
    ("zbv", 4, 2, 1, True),
    ("zbv", 2, 2, 4, False),
    ("dualpipev", 4, 2, 4, True),
    ("dualpipev", 4, 2, 3, False),
])
def test_requirement(kind: str, k: int, n: int, m: int, met: bool) -> None:
    sentence, ok = requirement(kind, k, n, m)
    assert ok == met
    assert sentence.startswith(f"{kind} runs on torch's {ZERO_BUBBLE[kind]}")
    assert f"({k} stages on {n} ranks" in sentence


def test_selective_stages_are_refused_before_any_is_touched() -> None:
    adapters = [types.SimpleNamespace(recompute=mode, microbatches=None, split_backward=False)
                for mode in ("full", "selective:8:8")]
    stages = [types.SimpleNamespace(submod=adapter) for adapter in adapters]
    with pytest.raises(ValueError, match="zb1p runs each stage's backward in two passes, "
                                         "which selective recompute cannot: split again"):
        zero_bubble_schedule("zb1p", stages, [0, 1], 4, None)
    assert all(a.microbatches is None and not a.split_backward for a in adapters)


class Cut(nn.Module):
    """A stage cut where torch's split backward trips: ``h`` is sent and also saved by
    ``fc`` for its weight gradient, ``v`` is a view, and the input's gradient is a slice
    of the ``cat``'s."""

    INPUTS = ("x",)
    OUTPUTS = ("h", "v")

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(torch.cat([x, torch.ones_like(x)], dim=1))
        return h, self.fc(h).t()


def _split_backward(adapter: StageAdapter, x: torch.Tensor) -> torch.Tensor:
    """What torch's stage does for I, then W; the input gradient."""
    outputs = adapter(x)
    grads = [torch.ones_like(out) for out in outputs]
    (dx,), groups = stage_backward_input(list(outputs), grads, [x], adapter.parameters())
    stage_backward_weight(adapter.parameters(), groups)
    return dx


def test_split_backward_sends_clones_and_contiguous_input_gradients() -> None:
    torch.manual_seed(0)
    stage = Cut()
    adapter = StageAdapter(stage, ("x",), ("h", "v"), {}, lambda values: values)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError):  # as generated: torch detaches a view, or h, in place
        _split_backward(adapter, x)

    adapter.split_backward = True
    stage.zero_grad(set_to_none=True)
    x = torch.randn(2, 4, requires_grad=True)
    dx = _split_backward(adapter, x)
    assert dx.is_contiguous()
    got = {name: p.grad.clone() for name, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    want_x = x.detach().requires_grad_()
    h, v = stage(want_x)
    (h.sum() + v.sum()).backward()
    torch.testing.assert_close(dx, want_x.grad)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(got[name], p.grad)
