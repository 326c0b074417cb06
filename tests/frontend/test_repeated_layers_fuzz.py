"""Random stacks of identical layers through the repeated-layer export
(fxpipe.tracing.repeats): whenever the layers are copied, the graph computes the model.

Each model is a list of 6 to 9 layers (8 to 12 where they alternate) of one random block
(a few of linear, activation, layer norm, a residual add, a product with a per-layer
parameter, softmax) run in order, with at most one way the layers do not all run alike,
drawn with the layer it touches:

    scale       that layer's block multiplies by another constant (a Python attribute)
    index       that layer's forward branches on its own index
    skip        the loop adds an earlier layer's output before that layer
    shared      every layer adds one tensor the model made before the layers (legit)
    first       every layer after the first adds the first layer's output (legit)
    alternate   every other layer's block multiplies by another constant (legit: the
                layers repeat with a period of two, as sliding-window and full
                attention alternate)

Copying is always allowed to refuse; what it must never do is copy and compute
something else. The legit ones (and none at all) must be copied, so the property is
not met by refusing everything.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fxpipe.tracing.layer_runs import MIN_LAYERS
from fxpipe.tracing.repeats import export_in_layers

WIDTH = 8
EXAMPLES = int(os.environ.get("FXPIPE_FUZZ_EXAMPLES", "25"))
OPS = ("linear", "relu", "gelu", "tanh", "norm", "residual", "scale_param", "softmax")
LEGIT = (None, "shared", "first", "alternate")


class _Block(nn.Module):
    def __init__(self, ops: tuple[str, ...], index: int, constant: float,
                 branch_at: int | None) -> None:
        super().__init__()
        self.ops = ops
        self.index = index
        self.constant = constant
        self.branch_at = branch_at
        self.linears = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for op in ops if op == "linear")
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for op in ops if op == "norm")
        self.weight = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        start = x
        linears, norms = iter(self.linears), iter(self.norms)
        for op in self.ops:
            if op == "linear":
                x = next(linears)(x)
            elif op in ("relu", "gelu", "tanh"):
                x = getattr(torch, op)(x) if op != "gelu" else nn.functional.gelu(x)
            elif op == "norm":
                x = next(norms)(x)
            elif op == "residual":
                x = x + start
            elif op == "scale_param":
                x = x * self.weight
            else:
                x = torch.softmax(x, dim=-1)
        if extra is not None:
            x = x + extra
        if self.branch_at is not None and self.index == self.branch_at:
            x = x * 3
        return x * self.constant


def _scaled(variation: str | None, index: int, at: int) -> bool:
    """Whether layer ``index`` multiplies by another constant."""
    return (variation == "scale" and index == at) or (variation == "alternate" and index % 2 == 1)


class _Stack(nn.Module):
    def __init__(self, ops: tuple[str, ...], layers: int, variation: str | None,
                 at: int) -> None:
        super().__init__()
        self.variation = variation
        self.at = at
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(
            _Block(ops, i, 2.0 if _scaled(variation, i, at) else 1.0,
                   at if variation == "index" else None)
            for i in range(layers))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        shared = torch.tanh(x) if self.variation == "shared" else None
        outputs: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if self.variation == "skip" and i == self.at:
                x = x + outputs[i - 2]
            extra = shared if self.variation == "shared" else (
                outputs[0] if self.variation == "first" and i > 0 else None)
            x = layer(x, extra)
            outputs.append(x)
        return self.head(x)


@st.composite
def stacks(draw: st.DrawFn) -> tuple[_Stack, str | None]:
    ops = tuple(draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=5)))
    variation = draw(st.sampled_from([None, "scale", "index", "skip", "shared", "first",
                                      "alternate"]))
    # alternating layers are copied where as many are left to copy as are exported:
    # four of an even count from eight, five of an odd count from eleven
    layers = draw(st.sampled_from((8, 10, 11, 12)) if variation == "alternate"
                  else st.integers(MIN_LAYERS, MIN_LAYERS + 3))
    at = draw(st.integers(2 if variation == "skip" else 0, layers - 1))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    return _Stack(ops, layers, variation, at).double(), variation


def _run(gm: torch.fx.GraphModule, flat: tuple[Any, ...]) -> torch.Tensor:
    out = torch.fx.Interpreter(gm).run(*flat)
    return out if isinstance(out, torch.Tensor) else out[0]


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(stacks())
def test_copied_layers_compute_the_model(drawn: tuple[_Stack, str | None]) -> None:
    model, variation = drawn
    x = torch.randn(3, WIDTH, dtype=torch.float64)
    layered = export_in_layers(model, (x,), {})
    if variation in LEGIT:
        assert layered is not None, f"{variation}: layers that run alike were not copied"
    if layered is None:
        return
    gm, flat, *_ = layered
    with torch.no_grad():
        torch.testing.assert_close(_run(gm, flat), model(x))
