"""The passes take a copied layer's records from the node it copies (``meta.COPY_OF``),
without running it, and run any node whose record no longer names such a node."""

from __future__ import annotations

from unittest import mock

import torch
from torch import nn

from fxpipe import meta
from fxpipe.passes import annotate_all
from fxpipe.passes.base import copied_from
from fxpipe.passes.memory import _MemoryCount


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * x


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Block(), _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)).sum()


def _graph() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return torch.fx.symbolic_trace(_Two())


def _records(gm: torch.fx.GraphModule, x: torch.Tensor) -> list[tuple[object, ...]]:
    annotate_all(gm, x)
    return [(meta.SHAPE.get(n), meta.FLOPS.get(n), meta.BYTES.get(n)) for n in gm.graph.nodes]


def _mark_b_as_copy_of_a(gm: torch.fx.GraphModule) -> int:
    """Name, on each op node of block b, the same op of block a; the number marked."""
    a = [n for n in gm.graph.nodes if n.name.startswith("a_") or n.name in ("relu", "mul")]
    b = [n for n in gm.graph.nodes if n.name.startswith("b_") or n.name in ("relu_1", "mul_1")]
    assert [n.target.split(".")[-1] if n.op == "call_module" else n.target for n in a] == [
        n.target.split(".")[-1] if n.op == "call_module" else n.target for n in b]
    for template, copy in zip(a, b, strict=True):
        meta.COPY_OF.set(copy, template.name)
    return len(b)


def test_a_copy_takes_the_records_of_the_node_it_copies_without_running() -> None:
    x = torch.randn(4, 8)
    want = _records(_graph(), x)
    gm = _graph()
    marked = _mark_b_as_copy_of_a(gm)
    copies = copied_from(gm)
    # The linear of b is a call_module of another target: run, not taken (see below).
    assert {c.name: t.name for c, t in copies.items()} == {"relu_1": "relu", "mul_1": "mul"}
    assert marked == 3
    with mock.patch.object(_MemoryCount, "_as_copy", autospec=True,
                           side_effect=_MemoryCount._as_copy) as taken:
        got = _records(gm, x)
    assert sorted(call.args[1].name for call in taken.call_args_list) == ["mul_1", "relu_1"]
    assert got == want


def test_a_record_that_names_no_such_node_is_run() -> None:
    gm = _graph()
    nodes = {n.name: n for n in gm.graph.nodes}
    meta.COPY_OF.set(nodes["relu"], "relu_1")  # a later node
    meta.COPY_OF.set(nodes["mul_1"], "relu")  # another op
    meta.COPY_OF.set(nodes["relu_1"], "gone")  # no node of that name
    assert copied_from(gm) == {}
    x = torch.randn(4, 8)
    assert _records(gm, x) == _records(_graph(), x)
