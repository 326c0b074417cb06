"""Tensors forward computes from no traced value, such as torch's pipelining test model
``ExampleCode`` cloning a buffer (``c = self.buf.clone()``): symbolic_trace stored the
clone on the model as ``_tensor_constant0``, the stage bound ``model._tensor_constant0``,
and ``build_stages`` raised AttributeError on the model built again after ``split`` said
OPTIMAL. Now symbolic_trace refuses such a graph, torch.export records the clone, and the
stages read the buffer as it is when they run."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fxpipe.frontend import trace
from tests.codegen._models import import_package, run_stages, write_package
from tests.codegen._plans import contiguous_plan


class ClonedBuffer(nn.Module):
    """ExampleCode's pattern: a registered buffer cloned in forward and used later."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.randn(8))
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.buf.clone()
        return self.head(torch.relu(self.lin(x) + c))


def test_a_buffer_cloned_in_forward_reads_the_buffer_when_the_stages_run(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ClonedBuffer()
    traced = trace(model, (torch.randn(4, 8),))
    assert "_tensor_constant0" in (traced.fallback_reason or "")
    assert not [name for name in vars(model) if name.startswith("_tensor_constant")]
    state = {*dict(model.named_parameters()), *dict(model.named_buffers())}
    reads = {str(n.target) for n in traced.gm.graph.nodes if n.op == "get_attr"}
    assert reads <= state, reads - state  # every read is of the model's own state
    write_package(tmp_path / "pkg", traced, contiguous_plan(traced.gm.graph, 2))
    package = import_package(tmp_path / "pkg")

    # the model built again, as a training script does, with a buffer changed since
    again = ClonedBuffer()
    again.load_state_dict(model.state_dict())
    with torch.no_grad():
        again.buf.fill_(3.0)
    stages = package.build_stages(again)
    x = torch.randn(4, 8)
    assert torch.equal(run_stages(package, stages, (x,), {}), again(x))
