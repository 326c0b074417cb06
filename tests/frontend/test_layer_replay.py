"""symbolic_trace records one layer of a list of alike ones and replays it for the others
(``tracing/replay.py``): the graph is the one tracing every layer makes, node for node,
names and ``nn_module_stack`` included, and a layer that would trace otherwise is traced."""

from __future__ import annotations

import operator
from collections.abc import Callable

import pytest
import torch
from torch import nn

from fxpipe.tracing import replay
from fxpipe.tracing.replay import LayerReplay, ReplayMismatch
from fxpipe.tracing.symbolic import _traced

LAYERS = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        h = self.fc(self.norm(x)) * self.scale
        return x + (h.tril() if causal else h)


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _both(build: Callable[[], nn.Module]
          ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    """The graph with replaying and without (each of a model built afresh: tracing runs
    forward, which may change it), and how many layers were replayed."""
    torch.manual_seed(0)
    model = build()
    layers = LayerReplay(model)
    replayed = _traced(model, layers)
    torch.manual_seed(0)
    model = build()
    return replayed, _traced(model, LayerReplay(model, enabled=False)), layers.replayed


def _assert_same(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> None:
    assert a.code == b.code
    assert [(n.name, n.op, n.target, n.type, n.meta) for n in a.graph.nodes] == [
        (n.name, n.op, n.target, n.type, n.meta) for n in b.graph.nodes]


def test_a_list_of_alike_layers_is_replayed_as_traced() -> None:
    a, b, replayed = _both(Stack)
    assert replayed == LAYERS - 3  # the first two traced and compared, the last checked
    _assert_same(a, b)
    x = torch.randn(2, 8)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


class Alternating(Stack):
    """The layers called two ways, and a parameter of one read after them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, causal=i % 2 == 0)
        return x * self.layers[5].scale


def test_calls_of_another_form_replay_their_own_recording() -> None:
    a, b, replayed = _both(Alternating)
    assert replayed > 0
    _assert_same(a, b)


class Tupled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, aux + y.sum()


class Nested(nn.Module):
    """Layers that each hold a list of sublayers, returning two values, one read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList(Tupled() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.inner:
            x, aux = layer(x, aux)
        return x, aux


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Nested() for _ in range(LAYERS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = x.sum()
        for block in self.blocks:
            x, aux = block(x, aux)
        return x * aux


def test_nested_lists_and_tuples_replay_as_traced() -> None:
    a, b, replayed = _both(Outer)
    assert replayed >= LAYERS - 3
    _assert_same(a, b)


class Branching(nn.Module):
    """A linear layer whose output is doubled where ``doubled`` says, in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def doubled(self) -> bool:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 2 if self.doubled() else self.fc(x)


class Indexed(Branching):
    index = 0

    def doubled(self) -> bool:
        return self.index % 3 != 0


class SetsIndex(Stack):
    """Sets an attribute of each layer before calling it: the layers trace apart."""

    def __init__(self) -> None:
        super().__init__(Indexed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            layer.index = i
            x = layer(x)
        return x


_DEPTH = [0]


class ReadsGlobal(Branching):
    @property
    def deep(self) -> bool:  # a property reads the global: its key holds it too
        return _DEPTH[0] == 4

    def doubled(self) -> bool:
        return self.deep


class SetsGlobal(Stack):
    """Sets a global the layers read before each call: one layer traces apart."""

    def __init__(self) -> None:
        super().__init__(ReadsGlobal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            _DEPTH[0] = i
            x = layer(x)
        return x


class Counts(Branching):
    calls = 0

    def doubled(self) -> bool:
        self.calls += 1
        return self.calls >= 2


class Twice(Stack):
    """Runs its layers twice (the second pass traces otherwise, and names calls @1)."""

    def __init__(self) -> None:
        super().__init__(Counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return x


@pytest.mark.parametrize("model", [SetsIndex, SetsGlobal, Twice])
def test_a_layer_that_would_trace_otherwise_is_traced(model: type[nn.Module]) -> None:
    a, b, _ = _both(model)
    _assert_same(a, b)
    # some layers took the other branch, as tracing each one finds
    calls = sum(n.op == "call_module" for n in a.graph.nodes)
    assert 0 < sum(n.target is operator.mul for n in a.graph.nodes) < calls


def test_a_last_layer_unlike_its_replays_traces_the_model_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the last layer does not trace as the replayed ones were, replay is wrong
    somewhere: the tracer says so, and symbolic_graph traces again without it."""
    model = Stack(Block)
    same = replay._same
    seen = []

    def unlike_at_the_end(first: object, second: object) -> bool:
        seen.append(second)
        return same(first, second) and len(seen) < 2  # the first compare, then the last

    monkeypatch.setattr(replay, "_same", unlike_at_the_end)
    with pytest.raises(ReplayMismatch, match=r"layers\.7 does not trace as layers\.1 did"):
        _traced(model, LayerReplay(model))


def test_symbolic_graph_traces_again_where_replay_was_wrong(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.tracing import symbolic

    tries = []
    traced = symbolic._traced

    def mismatched_once(model: nn.Module, layers: LayerReplay) -> torch.fx.GraphModule:
        tries.append(layers)
        if len(tries) == 1:
            raise ReplayMismatch("layers.7 does not trace as layers.1 did")
        return traced(model, layers)

    monkeypatch.setattr(symbolic, "_traced", mismatched_once)
    gm, _, _ = symbolic.symbolic_graph(Stack(), (torch.randn(2, 8),), {})
    assert len(tries) == 2 and tries[1].replayed == 0
    assert gm.code == _traced(Stack(), LayerReplay(Stack(), enabled=False)).code


def test_layers_sharing_a_module_or_keeping_a_tensor_or_a_cycle_are_traced() -> None:
    def shared() -> nn.Module:
        model = Stack()
        for layer in model.layers:
            layer.norm = model.layers[0].norm
        return model

    def kept() -> nn.Module:
        model = Stack()
        for layer in model.layers:
            layer.mask = torch.ones(8)  # no parameter or buffer: a key cannot hold it
        return model

    def cyclic() -> nn.Module:
        model = Stack()
        for layer in model.layers:
            layer.path = [0]
            layer.path.append(layer.path)  # holds itself: no key compares it
        return model

    for build in (shared, kept, cyclic):
        a, b, replayed = _both(build)
        assert replayed == 0
        _assert_same(a, b)


class Again(Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return x


def test_a_layer_called_again_is_traced_and_named_a_second_call() -> None:
    a, b, replayed = _both(Again)
    assert replayed == LAYERS - 3  # the first pass only
    _assert_same(a, b)
    assert "layers.5@1" in next(n for n in a.graph.nodes
                                if n.target == "layers.5.fc" and n.name.endswith("_1")
                                ).meta["nn_module_stack"]
