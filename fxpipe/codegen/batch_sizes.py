"""Sizes that count the batch, recomputed by each stage from its own rows.

A stage may receive an int another stage computed from its rows (``h.size(0)``,
``sym_size(x, 0) * 4``) and use it to reshape (``view(size_3, size_4, 4, 32)``). When
the two stages run on different shares of a micro-batch (a stage replicated on r GPUs
runs each replica on a 1/r share), the received count is the other stage's, and the
reshape fails or, worse, succeeds on the wrong rows. So a stage that receives such an
int computes it again on entry from a tensor it receives whose dim 0 is the batch.

Which values have the batch as dim 0 is read off the capture, never off a size alone:
traced at one row, a rotary table of shape (1, T, D) has dim 0 of the batch size too,
and a count read from it is 1 whatever the rows. torch.export names each batched
input's dim 0 by a symbol, and a value has the batch as dim 0 when its dim 0 is that
symbol; a graph without such symbols (symbolic_trace) is run once more on the meta
device with every batched input one row longer, and a value has the batch as dim 0
when its dim 0 grew with them. A stage that receives no such value keeps the count it
received: the stage that sent it ran the same micro-batch (when that stage is replicated,
the runtime hands on replica 0's count, its share: left open, as no such stage is known).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe import meta
from fxpipe.cut import StageIO
from fxpipe.frontend import Traced
from fxpipe.metadevice import MetaRunner, copied_from

__all__ = ["BatchDims"]


@dataclass(frozen=True)
class BatchDims:
    """What a graph says about its batch dimension, read once for all its stages: the
    rows it was traced at (``batch``; None: no batched input), the values that are one
    tensor with the batch as dim 0 (``rows``), the tensors known to have no batch dim
    (``without``), and the batch counts (``multiples``: node name -> c for a node whose
    value is c times the rows)."""

    batch: int | None
    rows: frozenset[str]
    without: frozenset[str]
    multiples: dict[str, int]

    @classmethod
    def of(cls, graph: torch.fx.Graph, batch: int | None, shared: Collection[str],
           widened: Mapping[str, int] | None = None) -> BatchDims:
        """``graph`` traced at ``batch`` rows; ``shared`` graph inputs have no batch dim;
        ``widened``: dim 0 of each tensor value in a run at ``batch`` + 1 rows (see
        ``widened_rows``), read where torch.export named no batch symbol."""
        shared = frozenset(shared)
        symbols = _batch_symbols(graph, shared)
        rows, without = set(), set()
        for node in graph.nodes:
            kind = _kind(node, batch, shared, symbols, widened)
            if kind == "rows":
                rows.add(node.name)
            elif kind == "without":
                without.add(node.name)
        return cls(batch, frozenset(rows), frozenset(without), _batch_multiples(graph, rows))

    @classmethod
    def of_traced(cls, traced: Traced, ios: Sequence[StageIO] = (), *,
                  replicated: bool = True) -> BatchDims:
        """``of`` for a traced model cut into the stages ``ios``: its batch is dim 0 of
        its first batched input. The run one row longer (a second of meta-device work on
        a 70B graph) is made only where it tells something: a stage receives a count of
        dim 0, or stages are ``replicated`` (their replicas take unbatched values whole)."""
        shared = traced.shared_inputs
        batch = next((shape.shape[0] for shape in traced.inputs
                      if shape.shape and shape.name not in shared), None)
        graph = traced.gm.graph
        widened = None
        if batch is not None and not _batch_symbols(graph, shared):
            counts = _batch_multiples(graph, {n.name for n in graph.nodes})  # of any dim 0
            if replicated or any(name in counts for io in ios for name in io.inputs):
                widened = widened_rows(traced.gm, traced.flat_inputs, batch, shared)
        return cls.of(graph, batch, shared, widened)

    def recount_lines(self, io: StageIO) -> list[str]:
        """``forward``'s entry lines that recompute each batch count stage ``io`` receives
        from the first tensor it receives with the batch as dim 0 (none when there is no
        such tensor, or nothing to recompute)."""
        source = next((name for name in io.inputs if name in self.rows), None)
        if source is None:
            return []
        lines = []
        for name in io.inputs:
            scale = self.multiples.get(name)
            if scale is not None:
                count = f"{source}.size(0)" if scale == 1 else f"{scale} * {source}.size(0)"
                lines.append(f"        {name} = {count}  # this stage's own rows")
        return lines

    def unbatched(self, io: StageIO) -> tuple[str, ...]:
        """The tensors stage ``io`` receives or sends that have no batch dimension (an
        ``arange`` over a feature dim that happens to be as long as the batch, a rotary
        table of one row). A replicated stage's replicas take these whole instead of a
        share of their rows. Empty where the capture cannot tell (a graph that runs only
        at the traced batch size)."""
        return tuple(name for name in (*io.inputs, *io.outputs) if name in self.without)


def widened_rows(gm: torch.fx.GraphModule, flat_inputs: Sequence[Any], batch: int,
                 shared: Collection[str]) -> dict[str, int] | None:
    """Dim 0 of every tensor value of ``gm`` run on the meta device with each batched
    graph input (a tensor with a dimension, not in ``shared``) given ``batch`` + 1 rows;
    None where the graph does not run so (a size fixed in the graph)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat_inputs):
        return None

    def wider(node: torch.fx.Node, value: Any) -> Any:
        if (not isinstance(value, torch.Tensor) or value.dim() == 0 or node.name in shared
                or value.size(0) != batch):
            return value
        return torch.empty((batch + 1, *value.shape[1:]), dtype=value.dtype, device="meta")

    runner = _RowsRunner(gm)
    try:
        runner.run_on_meta(*(wider(n, v) for n, v in zip(placeholders, flat_inputs,
                                                          strict=True)))
    except Exception:
        return None
    return runner.rows


class _RowsRunner(MetaRunner):
    """Notes dim 0 of every value that is one tensor with a dimension."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, copies=copied_from(gm))  # a repeated layer run once
        self.rows: dict[str, int] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if isinstance(result, torch.Tensor) and result.dim() > 0:
            self.rows[n.name] = int(result.size(0))
        return result


def _kind(node: torch.fx.Node, batch: int | None, shared: frozenset[str],
          symbols: frozenset[Any], widened: Mapping[str, int] | None) -> str | None:
    """What ``node``'s dim 0 is: "rows" for one tensor whose dim 0 is the batch,
    "without" for a tensor with no batch dim, None for neither or nothing to tell by."""
    if batch is None or not meta.SHAPE.has(node):
        return None
    info = meta.SHAPE.get(node)
    if not (info.single and len(info.tensors) == 1 and info.tensors[0].shape):
        return None
    if node.name in shared:
        return "without"
    traced = info.tensors[0].shape[0]
    if symbols:  # torch.export: what dim 0 is an expression of
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        rows = value.shape[0]
        if isinstance(rows, torch.SymInt) and rows.node.expr in symbols:
            return "rows" if traced == batch else None
        return None if _row_symbols(node) & symbols else "without"
    if widened is not None:  # run again one row longer: what grew with the batch
        grown = widened.get(node.name)
        if grown is None:
            return None
        if traced == batch and grown == batch + 1:
            return "rows"
        return "without" if grown == traced else None
    # Nothing to tell by but the size. A graph input of the batch size is batched; so is
    # any other value of it where the batch is more than one row (at one row, a table of
    # one row would pass for rows).
    return "rows" if traced == batch and (batch > 1 or node.op == "placeholder") else None


def _batch_multiples(graph: torch.fx.Graph, rows: Collection[str]) -> dict[str, int]:
    """Node name -> c for each node whose value is c times dim 0 of a value in ``rows``:
    ``x.size(0)``, ``x.shape[0]``, ``aten.sym_size.int(x, 0)``, and those times an int
    constant."""
    found: dict[str, int] = {}
    for node in graph.nodes:
        if _is_rows(node, rows):
            found[node.name] = 1
        elif node.op == "call_function" and node.target is operator.mul:
            a, b = node.args[:2]
            for size, scale in ((a, b), (b, a)):
                if (isinstance(size, torch.fx.Node) and size.name in found
                        and isinstance(scale, int) and not isinstance(scale, bool)):
                    found[node.name] = found[size.name] * scale
                    break
    return found


def _is_rows(node: torch.fx.Node, rows: Collection[str]) -> bool:
    """``node`` reads dim 0 of a value in ``rows``."""
    if node.op == "call_method" and node.target == "size":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        source = node.args[0]
    elif node.op == "call_function" and node.target is torch.ops.aten.sym_size.int:
        source, dim = node.args[0], node.args[1]
    elif node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        whole = node.args[0]  # x.size()[0] or x.shape[0]
        if not isinstance(whole, torch.fx.Node) or not (
                (whole.op == "call_method" and whole.target == "size" and len(whole.args) == 1
                 and not whole.kwargs)
                or (whole.op == "call_function" and whole.target is getattr
                    and whole.args[1] == "shape")):
            return False
        source, dim = whole.args[0], 0
    else:
        return False
    return isinstance(dim, int) and dim == 0 and isinstance(source, torch.fx.Node) \
        and source.name in rows


def _batch_symbols(graph: torch.fx.Graph, shared: Collection[str]) -> frozenset[Any]:
    """The symbols torch.export names the batched graph inputs' dim 0 by."""
    return frozenset().union(*(_row_symbols(node) for node in graph.nodes
                               if node.op == "placeholder" and node.name not in shared))


def _row_symbols(node: torch.fx.Node) -> set[Any]:
    """The symbols dim 0 of ``node``'s tensor is an expression of (none when fixed)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return set()
    rows = value.shape[0]
    return set(rows.node.expr.free_symbols) if isinstance(rows, torch.SymInt) else set()
