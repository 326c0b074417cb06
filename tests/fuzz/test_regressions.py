"""Failures the fuzzer found (tests/fuzz/test_transparency.py), each kept as a small
model split and checked end to end, with the fix it needed."""

from __future__ import annotations

import torch
from torch import nn

from fxpipe.frontend import trace
from fxpipe.passes import annotate_all


class _InplaceOnModuleOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu_())


def test_flops_pass_runs_in_place_ops() -> None:
    # The FLOP pass ran each node on views of fresh leaves; autograd rejects an in-place
    # op on a view of a leaf that requires grad ("a view of a leaf Variable ..."), so any
    # model with `linear(x).relu_()` failed analysis. Fixed: run on clones of the leaves.
    model = _InplaceOnModuleOutput().double()
    x = torch.randn(2, 6, dtype=torch.float64)
    traced = trace(model, (x,))
    annotate_all(traced.gm, *traced.flat_inputs)
