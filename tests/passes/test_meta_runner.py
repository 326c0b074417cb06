"""The meta-device interpreter every pass shares: device literals, grad mode, failures."""

from __future__ import annotations

import pytest
import torch

from fxpipe import meta
from fxpipe.frontend import trace
from fxpipe.passes import AnalysisError, annotate_shapes


class DeviceLiterals(torch.nn.Module):
    """Ops that name the CPU: export records the device of the trace in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-1], device=x.device).to(torch.device("cpu"))
        return self.lin(x).cpu() + positions


def test_cpu_device_literals_run_on_meta() -> None:
    traced = trace(DeviceLiterals(), (torch.randn(2, 4),))
    annotate_shapes(traced.gm, *traced.flat_inputs)
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    assert meta.SHAPE.get(out).tensors[0].shape == (2, 4)


class Broken(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(3, 3)  # (2, 4) @ (3, 3): fails at this node


def test_a_failed_analysis_names_the_node_and_restores_grad_mode() -> None:
    gm = torch.fx.symbolic_trace(Broken())
    assert torch.is_grad_enabled()
    with torch.no_grad():
        with pytest.raises(AnalysisError, match="matmul"):
            annotate_shapes(gm, torch.randn(2, 4))
        assert not torch.is_grad_enabled()  # the caller's mode, restored
    assert torch.is_grad_enabled()
