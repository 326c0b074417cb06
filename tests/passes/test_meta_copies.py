"""Every meta-device run (the trace's check and size probes, the run one row longer)
runs a repeated layer once: a node of a copied layer (``meta.COPY_OF``) whose inputs are
like those of the node it copies takes that node's run (``MetaRunner``'s ``copies``)."""

from __future__ import annotations

from typing import Any

import torch

from fxpipe import meta
from fxpipe.codegen.batch_sizes import widened_rows
from fxpipe.frontend import trace
from fxpipe.metadevice import MetaRunner, copied_from
from fxpipe.tracing import symbolic
from tests.passes.test_copied_layers import _ConvStack, _MutatingStack


class _Counting(MetaRunner):
    """Counts the op nodes it really runs, by name."""

    def __init__(self, gm: torch.fx.GraphModule, copies: dict[Any, Any]) -> None:
        super().__init__(gm, copies=copies)
        self.ran: list[str] = []

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        self.ran.append(str(target))
        return super().call_module(target, args, kwargs)


def _specs(value: Any) -> Any:
    return [(t.shape, t.stride(), t.dtype, t.requires_grad) for t in
            torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _run(gm: torch.fx.GraphModule, x: torch.Tensor, copies: dict[Any, Any]
         ) -> tuple[Any, list[str]]:
    runner = _Counting(gm, copies)
    return _specs(runner.run_on_meta(x)), runner.ran


def test_a_run_with_copies_runs_each_repeated_layer_once() -> None:
    """Blocks 2..5 copy block 1 (block 0 reads an input without grad): only blocks 0
    and 1 run their conv, and the result is the run of every node's."""
    torch.manual_seed(0)
    model, x = _ConvStack(), torch.randn(2, 4, 16)
    gm = trace(model, (x,)).gm
    copies = copied_from(gm)
    assert len(copies) == 12
    got, ran = _run(gm, x, copies)
    want, ran_all = _run(gm, x, {})
    assert ran == ["blocks.0.conv", "blocks.1.conv"]
    assert len(ran_all) == 6
    assert got == want


def test_a_copy_given_other_inputs_is_run() -> None:
    """Block 3 strides otherwise: it is no copy, and block 4, given a shorter input
    than block 2 was, runs too; block 5 then runs as block 4 did (block 4 is no template:
    only block 1's nodes are), so it runs as well."""
    torch.manual_seed(0)
    model, x = _ConvStack((1, 1, 1, 2, 1, 1)), torch.randn(2, 4, 16)
    gm = trace(model, (x,)).gm
    got, ran = _run(gm, x, copied_from(gm))
    want, _ = _run(gm, x, {})
    assert ran == ["blocks.0.conv", "blocks.1.conv", "blocks.3.conv", "blocks.4.conv",
                   "blocks.5.conv"]
    assert got == want


def test_an_op_that_changes_its_inputs_in_place_runs_in_every_copy() -> None:
    """``z.mul_(w)`` makes ``z`` require grad: every layer runs it, and the values after
    it are those of the run of every node."""
    torch.manual_seed(0)
    model, x = _MutatingStack(), torch.randn(2, 8)
    gm = trace(model, (x,)).gm
    runs: dict[str, int] = {}

    class Noting(MetaRunner):
        def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
            runs[target] = runs.get(target, 0) + 1
            return super().call_method(target, args, kwargs)

    out = Noting(gm, copies=copied_from(gm)).run_on_meta(x)
    assert runs["mul_"] == 6
    assert _specs(out) == _specs(MetaRunner(gm).run_on_meta(x))


def test_the_run_one_row_longer_takes_the_copied_layers_rows() -> None:
    """``widened_rows`` of a graph with copies named is that of the graph without."""
    torch.manual_seed(0)
    model, x = _ConvStack(), torch.randn(2, 4, 16)
    gm = trace(model, (x,)).gm
    assert copied_from(gm)
    got = widened_rows(gm, (x,), 2, ())
    for node in gm.graph.nodes:
        node.meta.pop(meta.COPY_OF.name, None)
    assert not copied_from(gm)
    assert got == widened_rows(gm, (x,), 2, ())


def test_the_trace_check_and_probes_run_a_repeated_layer_once(monkeypatch: Any) -> None:
    """``symbolic_graph`` names the copies before its check run and size probes, which
    then run blocks 2..5 as block 1; the sizes it finds free are those of every node's
    runs."""
    torch.manual_seed(0)
    model, x = _ConvStack(), torch.randn(2, 4, 16)
    made: list[MetaRunner] = []

    class Kept(MetaRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(symbolic, "MetaRunner", Kept)
    monkeypatch.setattr(symbolic, "FORK_MIN_NODES", 10**9)  # probes here, not in a child
    _, _, shapes = symbolic.symbolic_graph(model, (x,), {})
    assert made and all(len(runner.copies) == 12 for runner in made)
    monkeypatch.setattr(symbolic, "_copies", lambda gm, model: {})
    _, _, every_node = symbolic.symbolic_graph(_ConvStack(), (x,), {})
    assert shapes == every_node


class _SplitBlock(torch.nn.Module):
    """Attention's ``qkv(x).split``: parts with gaps between their rows, that require
    grad, viewed and transposed after."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(8, dim=-1)
        q = q.view(2, 4, 2, 4).transpose(1, 2)
        return x + (q.transpose(1, 2).reshape(2, 4, 8) * k + v)


class _SplitStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_SplitBlock() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_copied_value_keeps_the_strides_of_the_value_it_copies() -> None:
    """A copy's value has the copied node's strides, also a ``split`` part with gaps: the
    nodes after it then see the inputs the copied layer's did and are taken as copies
    too (dense stand-ins made each copied layer run its ``getitem``, ``view`` and
    ``transpose`` again); the run's result is the run of every node's."""
    torch.manual_seed(0)
    model, x = _SplitStack(), torch.randn(2, 4, 8)
    gm = trace(model, (x,)).gm
    copies = copied_from(gm)
    assert len(copies) == 4 * sum(1 for n in gm.graph.nodes if n in copies.values()) > 0
    ran: list[str] = []

    class Noting(MetaRunner):
        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            ran.append(getattr(target, "__name__", str(target)))
            return super().call_function(target, args, kwargs)

        def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
            ran.append(target)
            return super().call_method(target, args, kwargs)

    out = Noting(gm, copies=copies).run_on_meta(x)
    once = len(ran)
    ran.clear()
    every = Noting(gm).run_on_meta(x)
    assert _specs(out) == _specs(every)
    per_layer = len(ran) // 6
    assert once == 2 * per_layer  # blocks 0 and 1; blocks 2..5 copy block 1
