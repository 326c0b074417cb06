"""Where sequence parallelism applies between tensor-parallel pairs (Megatron-LM's,
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022), read off the graph annotated by ``passes/tensor_parallel.py``: a pure analysis.

# t: the TP degree; tokens: the dims of a value before its last (batch and sequence).

Between a row-parallel linear and the next column-parallel ones, every GPU of a split
holds the whole residual stream and runs the ops there (residual adds, LayerNorm or
RMSNorm, dropout) whole. Those ops act on each token alone, so the t GPUs can each run
them on 1/t of the tokens instead: the row's all-reduce becomes a reduce-scatter along a
token dim, and where the stream leaves for the next columns it is all-gathered, the same
bytes on the wire as the all-reduce (a ring all-reduce is a reduce-scatter and an
all-gather); those ops' FLOPs and kept activations divide by t::

    row ─► reduce-scatter ─► add, norm, dropout on tokens / t ─► all-gather ─► columns
                                 │
                                 └─► add, ... (the residual, still on tokens / t)

A gap is the ops reached from the rows' outputs through ops that act per token (the
residual stream runs on from one row's reach into the next's, so the rows whose outputs
have one shape share one gap), up to the values read by an op that does not: a column or
an LM head (which read every token), an op that mixes positions or changes the shape, or
the graph's output. Those values are the gap's exits, gathered whole where they are
made. A row whose output is read at once by such an op keeps its all-reduce (nothing
would run on a share), and so does one whose output has no token dim (fewer than two
dims).

What an op acting per token is, checked from the graph: an elementwise op (adds, casts,
activations, dropout) or a norm over the last dim (LayerNorm, RMSNorm, or the reduction
over the last dim an RMSNorm is written with), whose output keeps the row output's token
dims and, last, its width or 1; its inputs from outside the gap are weights, scalars, or
the residual values entering it (the stream from before, cut to this GPU's tokens where
it is met).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx

from fxpipe import meta
from fxpipe.partition.tensor_parallel import Shard
from fxpipe.passes.base import OP_NODES
from fxpipe.passes.tensor_parallel import layer_pattern, op_name

__all__ = ["Gap", "SequenceParallel", "sequence_gaps", "sequence_shards"]

# ops that act on each element alone (their other inputs broadcast over the tokens)
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "truediv", "neg", "pow", "exp", "sqrt", "rsqrt", "tanh",
    "sigmoid", "relu", "gelu", "silu", "erf", "dropout", "to", "_to_copy", "type_as",
    "float", "double", "half", "bfloat16", "contiguous", "clone", "detach", "alias",
    "iadd", "add_", "mul_",
})
# norms over the last dim (their statistics per token), as functions or aten ops
_NORMS = frozenset({"layer_norm", "rms_norm"})
# reductions an RMSNorm is written with: per token where taken over the last dim only
_REDUCTIONS = frozenset({"mean", "sum", "var"})
_MODULES = (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.Dropout, torch.nn.GELU,
            torch.nn.ReLU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Identity)


@dataclass(frozen=True)
class Gap:
    """The ops between row-parallel linears and the next column-parallel ones that run on
    1/t of the tokens (node names, in graph order): the rows whose outputs enter them
    (each row's all-reduce a reduce-scatter), the token dim they are split along (the
    one before the last) and how many tokens it holds (t must divide it), the values
    gathered whole where they leave (``exits``), and those cut to this GPU's tokens
    where they enter from outside (``entries``: the residual stream from before the
    first row, such as the embedding's output)."""

    rows: tuple[str, ...]
    dim: int
    tokens: int
    ops: tuple[str, ...]
    exits: tuple[str, ...]
    entries: tuple[str, ...]


@dataclass(frozen=True)
class SequenceParallel:
    """The graph's gaps (one per shape of the residual stream), and the rows that keep
    their all-reduce (by node name)."""

    gaps: tuple[Gap, ...]
    kept: tuple[str, ...]

    def at(self, t: int) -> tuple[Gap, ...]:
        """The gaps whose tokens t divides (the others' rows keep their all-reduce)."""
        return tuple(g for g in self.gaps if g.tokens % t == 0)

    def kept_at(self, gm: torch.fx.GraphModule, t: int) -> tuple[str, ...]:
        """The modules of the rows that keep their all-reduce at t (layer numbers ``*``)."""
        rows = (*self.kept, *(r for g in self.gaps if g.tokens % t for r in g.rows))
        by_name = {n.name: n for n in gm.graph.nodes}
        return tuple(dict.fromkeys(layer_pattern(meta.MODULE.get(by_name[r]).path or r)
                                   for r in rows))


def sequence_gaps(gm: torch.fx.GraphModule) -> SequenceParallel:
    """The gaps of ``gm`` (needs ``meta.SHARD`` and ``meta.SHAPE``): from each
    row-parallel linear, the ops acting per token its output reaches (the residual
    stream runs on from one row's gap into the next's: they are one gap)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    rows = [n for n in gm.graph.nodes if n.op in OP_NODES and meta.SHARD.has(n)
            and meta.SHARD.get(n).role == "row"]
    by_shape: dict[tuple[int, ...], tuple[list[torch.fx.Node], set[torch.fx.Node]]] = {}
    kept = []
    for row in rows:
        shape = _shape(row)
        ops = _reached(gm, row, shape) if shape is not None and len(shape) >= 2 else set()
        if not ops:
            kept.append(row.name)
            continue
        assert shape is not None
        joined, found = by_shape.setdefault(shape, ([], set()))
        joined.append(row)
        found |= ops
    gaps = []
    for shape, (joined, ops) in by_shape.items():
        exits = {v for v in (*joined, *ops) if any(u not in ops and _reads_values(u)
                                                    for u in v.users)}
        entries = {a for op in ops for a in op.all_input_nodes
                   if a not in ops and a not in joined and _carries_tokens(a, shape)}
        ordered = lambda nodes: tuple(n.name for n in sorted(nodes, key=order.__getitem__))  # noqa: E731
        gaps.append(Gap(ordered(joined), len(shape) - 2, shape[-2], ordered(ops),
                        ordered(exits), ordered(entries)))
    return SequenceParallel(tuple(gaps), tuple(kept))


def sequence_shards(ops: Sequence[torch.fx.Node], shards: Sequence[Shard],
                    gaps: Sequence[Gap]) -> tuple[Shard, ...]:
    """``shards`` (each op's ``Shard`` without sequence parallelism) with ``gaps`` run on
    each GPU's share of the tokens, as ``partition/tensor_parallel.py`` prices them: a
    gap's ops by tokens (their norms' weight gradients all-reduced), its rows'
    all-reduces reduce-scatters (and their gradients all-gathered), each value read
    outside gathered where it is made (its gradient reduce-scattered, but where only the
    graph's output reads it), no longer the reading column's or LM head's backward
    all-reduce, and kept whole (the column saves the gathered value for its weight
    gradient: measured with autograd's saved tensors), and each value entering cut
    locally (its gradient all-gathered)."""
    index = {node.name: i for i, node in enumerate(ops)}
    found = list(shards)

    def add(name: str, **changes: object) -> None:
        if name in index:
            i = index[name]
            found[i] = replace(found[i], **{k: getattr(found[i], k) + v
                                            for k, v in changes.items()})

    by_name = {node.name: node for node in ops}
    for gap in gaps:
        for name in gap.ops:
            if name in index:
                found[index[name]] = replace(found[index[name]], compute=True, values=True,
                                             inputs=True, tokens=True,
                                             backward_reduce_bytes=_param_bytes(by_name[name]))
        for name in gap.rows:
            if name in index:
                out = _nbytes(by_name[name])
                found[index[name]] = replace(found[index[name]], forward_reduce_bytes=0)
                add(name, forward_halves=(out,), backward_halves=(out,))
        for name in gap.exits:
            node = by_name.get(name)
            if node is None:
                continue
            readers = [u for u in node.users if u.name not in gap.ops and _reads_values(u)]
            inside = [u for u in readers if u.op != "output"]
            add(name, forward_halves=(_nbytes(node),),
                backward_halves=(_nbytes(node),) if inside else ())
            if inside and name in index:  # a column keeps the gathered value, whole
                found[index[name]] = replace(found[index[name]], values=False)
            for reader in inside:  # its gradient reduce-scattered: not all-reduced again
                if reader.name in index and found[index[reader.name]].backward_reduce_bytes:
                    found[index[reader.name]] = replace(found[index[reader.name]],
                                                        backward_reduce_bytes=0)
        for name in gap.entries:
            if name in by_name:
                add(name, backward_halves=(_nbytes(by_name[name]),))
    return tuple(found)


def _nbytes(node: torch.fx.Node) -> int:
    return meta.SHAPE.get(node).nbytes if meta.SHAPE.has(node) else 0


def _param_bytes(node: torch.fx.Node) -> int:
    """The bytes of the parameters ``node`` reads (a norm's weight and bias): their
    gradients, summed over this GPU's tokens only, are all-reduced."""
    owned = dict(meta.BYTES.get(node).params) if meta.BYTES.has(node) else {}
    for source in node.all_input_nodes:
        if source.op == "get_attr" and meta.BYTES.has(source):
            owned.update(meta.BYTES.get(source).params)
    return sum(owned.values())


def _reached(gm: torch.fx.GraphModule, row: torch.fx.Node, shape: tuple[int, ...]
             ) -> set[torch.fx.Node]:
    """The ops acting per token that ``row``'s output reaches through such ops."""
    ops: set[torch.fx.Node] = set()
    todo = [row]
    while todo:
        for user in todo.pop().users:
            if user not in ops and user.op in OP_NODES and _per_token(gm, user, shape):
                ops.add(user)
                todo.append(user)
    return ops


def _per_token(gm: torch.fx.GraphModule, node: torch.fx.Node, shape: tuple[int, ...]) -> bool:
    """Whether ``node`` acts on each token alone and keeps the tokens of ``shape``."""
    out = _shape(node)
    if out is None or out[:-1] != shape[:-1] or out[-1] not in (shape[-1], 1):
        return False
    if meta.SHARD.has(node) and meta.SHARD.get(node).role != "replicated":
        return False
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if not isinstance(module, _MODULES):
            return False
        shaped = getattr(module, "normalized_shape", (shape[-1],))
        return tuple(shaped) == (shape[-1],)
    name = op_name(node.target)
    if name in _ELEMENTWISE:
        return all(_broadcasts(a, shape) for a in node.all_input_nodes)
    if name in _NORMS:
        normalized = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        return isinstance(normalized, (list, tuple)) and list(normalized) == [shape[-1]]
    if name in _REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        return [d % len(shape) if isinstance(d, int) else None for d in dims] == [
            len(shape) - 1]
    return False


def _broadcasts(arg: torch.fx.Node, shape: tuple[int, ...]) -> bool:
    """An input an elementwise op of a gap may read: one with the gap's tokens (a value
    of the stream) or none of them (a weight, a scalar): not one that varies along
    other positions."""
    found = _shape(arg)
    if found is None:
        return True  # a scalar or a symbolic size
    lead = found[:-1]
    return lead == shape[:-1] or all(size == 1 for size in lead)


def _reads_values(user: torch.fx.Node) -> bool:
    """Whether ``user`` reads a value's elements (the graph's output, an op making a
    tensor), not only its size (which a value split by tokens gives whole)."""
    return user.op == "output" or (meta.SHAPE.has(user) and bool(meta.SHAPE.get(user).tensors))


def _carries_tokens(node: torch.fx.Node, shape: tuple[int, ...]) -> bool:
    found = _shape(node)
    return found is not None and found[:-1] == shape[:-1] and node.op != "get_attr"


def _shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    if not meta.SHAPE.has(node):
        return None
    tensors = meta.SHAPE.get(node).tensors
    return tuple(tensors[0].shape) if len(tensors) == 1 else None
