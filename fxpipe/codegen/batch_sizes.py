"""Sizes that count the batch, recomputed by each stage from its own rows.

A stage may receive an int another stage computed from its rows (``h.size(0)``,
``sym_size(x, 0) * 4``) and use it to reshape (``view(size_3, size_4, 4, 32)``). When
the two stages run on different shares of a micro-batch (a stage replicated on r GPUs
runs each replica on a 1/r share), the received count is the other stage's, and the
reshape fails or, worse, succeeds on the wrong rows. So a stage that receives such an
int computes it again on entry from a tensor it receives whose dim 0 is the batch.
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe import meta
from fxpipe.cut import StageIO

__all__ = ["BatchDims"]


@dataclass(frozen=True)
class BatchDims:
    """What a graph says about its batch dimension, read once for all its stages: the
    rows it was traced at (``batch``; None: no batched input), the graph inputs without a
    batch dim (``shared``), the batch counts (``multiples``: node name -> c for a node whose
    value is c times the rows), and the symbols torch.export names the inputs' dim 0 by."""

    nodes: dict[str, torch.fx.Node]
    batch: int | None
    shared: frozenset[str]
    multiples: dict[str, int]
    symbols: frozenset[Any]

    @classmethod
    def of(cls, graph: torch.fx.Graph, batch: int | None, shared: Collection[str]) -> BatchDims:
        shared = frozenset(shared)
        symbols = frozenset().union(*(_row_symbols(node) for node in graph.nodes
                                      if node.op == "placeholder"))
        return cls({node.name: node for node in graph.nodes}, batch, shared,
                   _batch_multiples(graph, batch, shared), symbols)

    def recount_lines(self, io: StageIO) -> list[str]:
        """``forward``'s entry lines that recompute each batch count stage ``io`` receives
        from the first tensor it receives with the batch as dim 0 (none when there is no
        such tensor, or nothing to recompute)."""
        rows = next((name for name in io.inputs if name in self.nodes
                     and _batched(self.nodes[name], self.batch, self.shared)), None)
        if rows is None:
            return []
        lines = []
        for name in io.inputs:
            scale = self.multiples.get(name)
            if scale is not None:
                count = f"{rows}.size(0)" if scale == 1 else f"{scale} * {rows}.size(0)"
                lines.append(f"        {name} = {count}  # this stage's own rows")
        return lines

    def unbatched(self, io: StageIO) -> tuple[str, ...]:
        """The tensors stage ``io`` receives or sends that have no batch dimension, where
        the capture says so: torch.export names each graph input's dim 0 by a symbol, so
        a tensor whose dim 0 involves none of them is not batched (an ``arange`` over a
        feature dim that happens to be as long as the batch). A replicated stage's
        replicas take these whole instead of a share of their rows. Empty when no graph
        input's dim 0 is a symbol (symbolic_trace, or a capture that fixed the batch):
        nothing to tell them apart by."""
        if not self.symbols:
            return ()
        return tuple(name for name in (*io.inputs, *io.outputs) if name in self.nodes
                     and isinstance(self.nodes[name].meta.get("val"), torch.Tensor)
                     and self.nodes[name].meta["val"].dim() > 0
                     and not _row_symbols(self.nodes[name]) & self.symbols)


def _batch_multiples(graph: torch.fx.Graph, batch: int | None,
                     shared: Collection[str]) -> dict[str, int]:
    """Node name -> c for each node whose value is c times dim 0 of a batched value
    (traced at ``batch`` rows; ``shared`` graph inputs have no batch dim): ``x.size(0)``,
    ``x.shape[0]``, ``aten.sym_size.int(x, 0)``, and those times an int constant."""
    if batch is None:
        return {}
    found: dict[str, int] = {}
    for node in graph.nodes:
        if _is_rows(node, batch, shared):
            found[node.name] = 1
        elif node.op == "call_function" and node.target is operator.mul:
            a, b = node.args[:2]
            for size, scale in ((a, b), (b, a)):
                if (isinstance(size, torch.fx.Node) and size.name in found
                        and isinstance(scale, int) and not isinstance(scale, bool)):
                    found[node.name] = found[size.name] * scale
                    break
    return found


def _is_rows(node: torch.fx.Node, batch: int, shared: Collection[str]) -> bool:
    """``node`` reads dim 0 of a batched tensor."""
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
        and _batched(source, batch, shared)


def _batched(node: torch.fx.Node, batch: int | None, shared: Collection[str]) -> bool:
    """``node`` is one tensor whose dim 0 was traced at ``batch`` rows, not a shared input."""
    if node.name in shared or not meta.SHAPE.has(node):
        return False
    info = meta.SHAPE.get(node)
    return bool(info.single and len(info.tensors) == 1 and len(info.tensors[0].shape) > 0
                and info.tensors[0].shape[0] == batch)


def _row_symbols(node: torch.fx.Node) -> set[Any]:
    """The symbols dim 0 of ``node``'s tensor is an expression of (none when fixed)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return set()
    rows = value.shape[0]
    return set(rows.node.expr.free_symbols) if isinstance(rows, torch.SymInt) else set()
