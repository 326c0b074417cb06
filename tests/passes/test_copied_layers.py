"""The passes take a copied layer's records from the node it copies (``meta.COPY_OF``),
without running it, and run any node whose record no longer names such a node."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from fxpipe import frontend, meta
from fxpipe.frontend import trace
from fxpipe.passes import annotate_all
from fxpipe.passes.base import copied_from
from fxpipe.passes.memory import _MemoryCount
from fxpipe.tracing import repeats, symbolic
from fxpipe.tracing.repeats import mark_copies


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


def _copies_taken(gm: torch.fx.GraphModule, x: torch.Tensor) -> list[str]:
    with mock.patch.object(_MemoryCount, "_as_copy", autospec=True,
                           side_effect=_MemoryCount._as_copy) as taken:
        annotate_all(gm, x)
    return [call.args[1].name for call in taken.call_args_list]


def test_a_copy_takes_the_records_of_the_node_it_copies_without_running() -> None:
    x = torch.randn(4, 8)
    want = _records(_graph(), x)
    gm = _graph()
    marked = _mark_b_as_copy_of_a(gm)
    copies = copied_from(gm)
    # b's linear is another module, of the same class, configuration and parameters
    assert {c.name: t.name for c, t in copies.items()} == {
        "b_linear": "a_linear", "relu_1": "relu", "mul_1": "mul"}
    assert marked == 3
    # a reads the model's input, b a value that requires grad: b's linear and mul are
    # given inputs unlike a's, so they are run; its relu is taken as a's
    assert _copies_taken(gm, x) == ["relu_1"]
    assert _records(gm, x) == want


def test_a_record_that_names_no_such_node_is_run() -> None:
    gm = _graph()
    nodes = {n.name: n for n in gm.graph.nodes}
    meta.COPY_OF.set(nodes["relu"], "relu_1")  # a later node
    meta.COPY_OF.set(nodes["mul_1"], "relu")  # another op
    meta.COPY_OF.set(nodes["relu_1"], "gone")  # no node of that name
    assert copied_from(gm) == {}
    x = torch.randn(4, 8)
    assert _records(gm, x) == _records(_graph(), x)


class _ConvBlock(nn.Module):
    def __init__(self, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) * 2


class _ConvStack(nn.Module):
    """Six blocks of one structure (the same parameters); ``strides`` may set one apart."""

    def __init__(self, strides: tuple[int, ...] = (1,) * 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ConvBlock(s) for s in strides)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.mark.parametrize("strides", [(1,) * 6, (1, 1, 1, 2, 1, 1)],
                         ids=["alike", "one stride apart"])
def test_symbolic_layers_are_taken_as_copies_only_where_they_run_alike(
        strides: tuple[int, ...]) -> None:
    """A traced whole graph of identical layers names layers 2.. copies of layer 1
    (``mark_copies``). A layer whose conv strides otherwise (the same weights) is not one,
    and the layer after it, given a shorter input, is run too."""
    torch.manual_seed(0)
    model, x = _ConvStack(strides), torch.randn(2, 4, 16)
    gm = trace(model, (x,)).gm  # symbolic_trace: the copies named as traced
    assert mark_copies(gm, model) == 4 * 3  # conv, relu, mul of blocks 2..5
    copies = copied_from(gm)
    if strides[3] == 1:
        assert len(copies) == 12
    else:  # block 3's conv is not block 1's
        assert "blocks_3_conv" not in {n.name for n in copies}
    taken = _copies_taken(gm, x)
    unmarked = trace(model, (x,)).gm
    for node in unmarked.graph.nodes:
        node.meta.pop(meta.COPY_OF.name, None)
    want = _records(unmarked, x)
    assert _records(gm, x) == want
    if strides[3] == 1:
        assert len(taken) == 12
    else:  # only block 2 runs as block 1 does: blocks 3.. see inputs of another length
        assert sorted(taken) == ["blocks_2_conv", "mul_2", "relu_2"]


class _Stem(nn.Module):
    """A first layer built otherwise than the rest (as DeepSeek-V3's dense ones are)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 5, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x))


def test_layers_after_one_built_otherwise_are_taken_as_copies_of_the_first_alike_one(
        ) -> None:
    """Block 1 reads the stem, so it runs unlike the blocks after it; block 2 is the first
    of those, and blocks 3.. are named its copies and take its records."""
    torch.manual_seed(0)
    model, x = _ConvStack((1,) * 7), torch.randn(2, 4, 16)
    model.blocks[0] = _Stem()  # six alike blocks follow: a list (``layer_lists``)
    gm = trace(model, (x,)).gm
    assert mark_copies(gm, model) == 4 * 3  # conv, relu, mul of blocks 3..6
    assert {t.name for t in copied_from(gm).values()} == {"blocks_2_conv", "relu_1", "mul_1"}
    taken = _copies_taken(gm, x)
    assert len(taken) == 12
    unmarked = trace(model, (x,)).gm
    assert _records(gm, x) == _records(unmarked, x)


class _MutatingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.zeros_like(x)
        z.mul_(self.linear(x))  # z now requires grad: an in-place op changes its input
        return torch.relu(z) * x


class _MutatingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MutatingBlock() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_an_op_that_changes_its_inputs_in_place_is_run_in_every_copy() -> None:
    """``z.mul_(w)`` makes ``z`` require grad: taken as a copy, it would leave the copy's
    ``z`` as it was, and the ops after it would read a value unlike the copied layer's.
    Such an op is run in every layer, and what it changed is what the copies after it
    see; so is a node whose result an in-place op changed after it ran."""
    torch.manual_seed(0)
    model, x = _MutatingStack(), torch.randn(2, 8)
    gm = trace(model, (x,)).gm
    assert sum(meta.COPY_OF.has(n) for n in gm.graph.nodes) == 4 * 5
    # zeros_like_k: its result z was changed by mul__k after it ran; mul__k changes z
    assert _copies_taken(gm, x) == [
        name for k in range(2, 6) for name in (f"blocks_{k}_linear", f"relu_{k}", f"mul_{k}")]
    got = [(meta.SHAPE.get(n), meta.FLOPS.get(n), meta.BYTES.get(n)) for n in gm.graph.nodes]
    for node in gm.graph.nodes:
        node.meta.pop(meta.COPY_OF.name, None)
    assert _records(gm, x) == got


def test_a_fault_in_naming_the_copies_is_not_taken_for_a_tracing_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``symbolic_trace`` worked: a bug in ``mark_copies`` must surface, not send the model
    through torch.export as if symbolic_trace had failed."""
    def broken(gm: torch.fx.GraphModule, model: nn.Module) -> int:
        raise RuntimeError("mark_copies broke")

    monkeypatch.setattr(symbolic, "mark_copies", broken)  # inside the fallback's try
    monkeypatch.setattr(frontend, "mark_copies", broken)
    with pytest.raises(RuntimeError, match="mark_copies broke"):
        trace(_ConvStack(), (torch.randn(2, 4, 16),))


def test_the_copies_are_named_once_a_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """symbolic_graph names the copies for its own runs and the frontend keeps them (at
    1,663 layers each naming is half a second): ``mark_copies`` runs once."""
    calls: list[str] = []

    def counted(gm: torch.fx.GraphModule, model: nn.Module) -> int:
        calls.append(type(model).__name__)
        return mark_copies(gm, model)

    monkeypatch.setattr(symbolic, "mark_copies", counted)
    monkeypatch.setattr(frontend, "mark_copies", counted)
    gm = trace(_ConvStack(), (torch.randn(2, 4, 16),)).gm
    assert calls == ["_ConvStack"]
    assert sum(meta.COPY_OF.has(n) for n in gm.graph.nodes) == 4 * 3


def test_a_naming_that_fails_part_way_names_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frontend names the copies again only where none are named: a naming that
    failed after the first list would otherwise leave it believing they all were."""
    model = _ConvStack()
    gm = torch.fx.symbolic_trace(model)
    lists = repeats.layer_lists(model)
    monkeypatch.setattr(repeats, "layer_lists",
                        lambda m: [*lists, _broken_list()])  # a second list that fails
    with pytest.raises(AttributeError):
        mark_copies(gm, model)
    assert not any(meta.COPY_OF.has(n) for n in gm.graph.nodes)
    monkeypatch.setattr(repeats, "layer_lists", lambda m: lists)
    assert mark_copies(gm, model) == 4 * 3


def _broken_list() -> object:
    class Broken:
        path = property(lambda self: self.missing)  # AttributeError when read
    return Broken()


class _Alternating(nn.Module):
    """Blocks of one structure whose forward differs by a flag set at build time: even
    ones tanh, odd ones sigmoid (sliding-window and full attention, every other layer);
    ``scale_by_index`` makes each block read its own index instead."""

    def __init__(self, index: int, scale_by_index: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.index, self.scale_by_index = index, scale_by_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_by_index:
            return self.linear(x) * (self.index + 1)
        act = torch.tanh if self.index % 2 == 0 else torch.sigmoid
        return act(self.linear(x)) + x


class _AlternatingStack(nn.Module):
    def __init__(self, scale_by_index: bool = False, every_output: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Alternating(i, scale_by_index) for i in range(7))
        self.every_output = every_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        return torch.stack(outputs).sum() if self.every_output else x.sum()


def _unmarked_records(model: nn.Module, x: torch.Tensor) -> list[tuple[object, ...]]:
    gm = trace(model, (x,)).gm
    for node in gm.graph.nodes:
        node.meta.pop(meta.COPY_OF.name, None)
    return _records(gm, x)


@pytest.mark.parametrize("every_output", [False, True], ids=["last output", "every output"])
def test_alternating_layers_are_copies_of_the_first_layer_of_their_phase(
        every_output: bool) -> None:
    """Period 2: blocks 3, 5 copy block 1 and blocks 4, 6 block 2 (block 0 reads the
    model's input, the first of its phase that reads a layer's); a model that reads every
    block's output copies them alike. The records are those of running every node."""
    torch.manual_seed(0)
    model, x = _AlternatingStack(every_output=every_output), torch.randn(4, 8)
    gm = trace(model, (x,)).gm
    copies = {c.name: t.name for c, t in copied_from(gm).items()}
    of_block = {f"blocks_{k}_linear": k for k in range(7)}
    linear_copies = {of_block[c]: of_block[t] for c, t in copies.items() if c in of_block}
    assert linear_copies == {3: 1, 4: 2, 5: 1, 6: 2}
    assert len(copies) == 4 * 3  # linear, activation, add of blocks 3..6
    assert _copies_taken(gm, x)  # the passes take them
    assert _records(gm, x) == _unmarked_records(model, x)


def test_layers_that_read_their_index_are_no_copies() -> None:
    """Each block multiplies by its own index + 1, a constant symbolic_trace writes into
    its graph: no two blocks have one graph, so none is named a copy."""
    torch.manual_seed(0)
    model, x = _AlternatingStack(scale_by_index=True), torch.randn(4, 8)
    gm = trace(model, (x,)).gm
    assert mark_copies(gm, model) == 0
    assert copied_from(gm) == {}
    assert _records(gm, x) == _unmarked_records(model, x)
