"""A recomputed stage runs twice: first to send its outputs on, again in the backward for
autograd to differentiate. Both runs must compute the same values, so the first runs as the
second does, with grad (saving nothing for a backward it never has)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.recompute import nothing_saved
from fxpipe.schedules import gpipe, one_f_one_b


class GradModeKernel(nn.Module):
    """A layer whose kernel depends on grad mode, as CPU attention with a mask that needs a
    gradient does (the math path with grad, the fused kernel without): the two kernels
    round differently; here the difference is made large enough to see in float64."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return y if torch.is_grad_enabled() else y + 1e-3


class Stage(nn.Module):
    def __init__(self, inputs: tuple[str, ...], outputs: tuple[str, ...], layer: nn.Module):
        super().__init__()
        self.INPUTS, self.OUTPUTS, self.layer = inputs, outputs, layer

    def forward(self, **inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.layer(*inputs.values()),)


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_a_recomputed_stage_sends_what_its_backward_differentiates(schedule: Any) -> None:
    torch.manual_seed(0)
    first, second = GradModeKernel(), nn.Linear(4, 2, dtype=torch.float64)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).pow(2).mean()

    loss_fn(second(first(x)), y).backward()  # the model trains with grad
    want = [p.grad.clone() for p in (*first.parameters(), *second.parameters())]
    for p in (*first.parameters(), *second.parameters()):
        p.grad = None
    stages = [Stage(("x",), ("h",), first), Stage(("h",), ("y",), second)]
    runner = PipelineRunner(stages, schedule=schedule(2, 4), microbatches=4,
                            flatten_inputs=lambda x: {"x": x},
                            build_output=lambda values: values["y"], recompute=[True, False])
    runner.step((x,), y, loss_fn)
    got = [p.grad for p in (*first.parameters(), *second.parameters())]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_nothing_saved_keeps_no_tensor_for_the_backward() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    packed: list[Any] = []

    def pack(t: torch.Tensor) -> Any:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with nothing_saved():
            y = torch.tanh(x).sin()  # both save a tensor for their backward
        assert y.requires_grad and packed == []
        with pytest.raises(RuntimeError, match="runs again"):
            y.sum().backward()
        torch.tanh(x)
    assert len(packed) == 1  # outside it, saved as usual
