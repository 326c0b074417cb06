"""Which ops shard how under tensor parallelism inside a host (Megatron-LM's layout), read
off the annotated graph's flow and shapes: a pure analysis, for the planner.

A pair: column-parallel linears (q, k and v, or a fused qkv; gate and up; an MLP's fc)
whose outputs flow, through ops that keep the split (views, elementwise ops, attention),
into one row-parallel linear that reduces them back to the width the columns read (o,
down, proj). On t GPUs each holds 1/t of the pair's weights and runs 1/t of its FLOPs on
1/t of its values; the row linear's partial outputs are summed by one all-reduce in the
forward and the columns' input gradients by one in the backward, each of the pair's
output bytes. Attention splits by heads: t must divide the heads and the KV heads (GQA).

The vocabulary: an LM head (a linear whose output reaches the graph's output, as wide as a
token embedding has rows) splits its rows and its logits stay split for a
vocabulary-parallel cross-entropy (whose all-reduces, a few numbers per token, are not
priced); its input gradient is all-reduced in the backward. The token embedding splits its
rows, and its output (each GPU's rows' lookups) is all-reduced in the forward.

Every other op stays replicated: norms, residual adds, position embeddings, a linear whose
output joins the model's main stream. The pattern is read from the graph's flow and
widths, not proved: the runtime that shards checks shapes when it runs.

Works on ``symbolic_trace`` graphs (``call_module`` of ``nn.Linear`` / ``nn.Embedding``)
and ``torch.export`` graphs (``aten.linear``, ``addmm`` or ``mm`` with a ``get_attr``
weight, possibly transposed; ``aten.embedding``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx

from fxpipe import meta
from fxpipe.partition.tensor_parallel import REPLICATED, Shard
from fxpipe.passes.base import OP_NODES

__all__ = ["Pair", "TensorParallel", "annotate_tensor_parallel", "embedding_rows", "layer_pattern",
           "linear_features", "op_name", "shards"]

# What flows from a column's output before reaching a linear spreads past this many ops
# only on the model's main stream (the residual): no pair is that long
REGION_CAP = 400
# torch's attention calls (F.scaled_dot_product_attention, aten's and its fused kernels)
_ATTENTION = "scaled_dot_product"
_MATMULS = frozenset({"matmul", "bmm"})


@dataclass(frozen=True)
class Pair:
    """A column-parallel / row-parallel pair (node names) and the module around it."""

    row: str
    columns: tuple[str, ...]
    module: str
    heads: int = 0  # its attention's heads (0: no attention, an MLP)
    kv_heads: int = 0  # its keys' and values' heads (GQA: fewer than heads)
    units: int = 0  # what a TP degree must divide (``meta.ShardInfo.units``)

    def refusal(self, t: int) -> str:
        """What t does not divide in this pair: its heads, its KV heads, or its width."""
        if self.heads and self.kv_heads % t and not self.heads % t:
            return f"the {self.kv_heads} KV heads of {self.module} ({self.heads} query heads)"
        if self.heads:
            return f"the {self.heads} attention heads of {self.module}"
        return f"the hidden width {self.units} of {self.module}"


@dataclass(frozen=True)
class TensorParallel:
    """The graph's pairs, its vocabulary-parallel ops' modules, and the modules whose
    parameters stay whole on every GPU (layer numbers written ``*``)."""

    pairs: tuple[Pair, ...]
    vocab: tuple[str, ...]
    replicated: tuple[str, ...]

    def splits_by(self, t: int) -> bool:
        return all(p.units % t == 0 for p in self.pairs)

    def degrees(self, most: int) -> list[int]:
        """The TP degrees up to ``most`` that split every pair."""
        return [t for t in range(1, most + 1) if self.splits_by(t)]

    def refusal(self, t: int) -> str | None:
        """What t does not divide (the first pair it cannot split); None if it splits all."""
        return next((p.refusal(t) for p in self.pairs if p.units % t), None)


def annotate_tensor_parallel(gm: torch.fx.GraphModule) -> TensorParallel:
    """Fill ``meta.SHARD`` on every op node (needs ``meta.SHAPE``, ``meta.BYTES`` and
    ``meta.MODULE``) and say what was found."""
    ops = [n for n in gm.graph.nodes if n.op in OP_NODES]
    linears = {n: f for n in ops if (f := linear_features(gm, n)) is not None}
    embeddings = {n: r for n in ops if (r := embedding_rows(gm, n)) is not None}
    reach = {n: _reach(n, linears) for n in linears}
    roles: dict[torch.fx.Node, meta.ShardInfo] = {}
    pairs = _pairs(linears, reach)
    for pair_row, columns, inside, units in pairs:
        group = pair_row.name
        for node in inside:
            roles[node] = meta.ShardInfo("inside", group, units)
        for node in columns:
            roles[node] = meta.ShardInfo("column", group, units)
        roles[pair_row] = meta.ShardInfo("row", group, units)
    vocab_rows = set(embeddings.values())
    for node, (out, _) in linears.items():
        found = reach[node]
        if (node not in roles and found is not None and found.output and not found.frontier
                and out in vocab_rows):
            for value in found.inside:
                roles.setdefault(value, meta.ShardInfo("inside", node.name))
            roles[node] = meta.ShardInfo("vocab_head", node.name)
    heads = {roles[n].group for n in roles if roles[n].role == "vocab_head"}
    head_rows = {linears[n][0] for n in linears if n.name in heads}
    for node, rows in embeddings.items():
        if rows in head_rows:
            roles[node] = meta.ShardInfo("vocab_embedding", node.name)
    for node in ops:
        meta.SHARD.set(node, roles.get(node, meta.ShardInfo("replicated")))
    summary = tuple(_pair(row, columns, inside, units) for row, columns, inside, units in pairs)
    vocab = tuple(meta.MODULE.get(n).path for n in ops if meta.SHARD.get(n).role.startswith(
        "vocab"))
    return TensorParallel(summary, tuple(dict.fromkeys(layer_pattern(p) for p in vocab)),
                          _replicated(ops))


def shards(ops: Sequence[torch.fx.Node], gm: torch.fx.GraphModule | None = None
           ) -> tuple[Shard, ...]:
    """Each op's ``Shard`` (the solver's plain data) from its ``meta.SHARD`` record: what
    is divided by t, and the all-reduces it adds (the pass's docstring); a pair's backward
    all-reduce on its first column; a row linear's bias whole (``gm``: where its modules
    are)."""
    found = []
    first_columns: set[str] = set()
    for node in ops:
        info = meta.SHARD.get(node)
        role = info.role
        output = meta.SHAPE.get(node).nbytes
        reads = sum(meta.SHAPE.get(a).nbytes for a in node.all_input_nodes
                    if a.op != "get_attr" and meta.SHAPE.has(a))
        if role == "column":
            first = info.group not in first_columns
            first_columns.add(info.group)
            found.append(Shard(compute=True, values=True,
                               backward_reduce_bytes=reads if first else 0))
        elif role == "inside":
            found.append(Shard(compute=True, values=True, inputs=True))
        elif role == "row":
            found.append(Shard(compute=True, inputs=True, forward_reduce_bytes=output,
                               whole_param_bytes=_bias_bytes(gm, node)))
        elif role == "vocab_embedding":
            found.append(Shard(compute=True, forward_reduce_bytes=output))
        elif role == "vocab_head":
            found.append(Shard(compute=True, values=True, backward_reduce_bytes=reads))
        else:
            assert role == "replicated", role
            found.append(REPLICATED)
    return tuple(found)


def _bias_bytes(gm: torch.fx.GraphModule | None, node: torch.fx.Node) -> int:
    """The bytes of a linear op's bias: an ``nn.Linear``'s, or ``linear``'s third argument
    or ``addmm``'s first, read by ``get_attr``; 0 where it has none."""
    if node.op == "call_module":
        bias = getattr(gm.get_submodule(str(node.target)), "bias", None) if gm else None
        return bias.numel() * bias.element_size() if isinstance(bias, torch.Tensor) else 0
    name = op_name(node.target)
    bias = (node.args[2] if name == "linear" and len(node.args) > 2
            else node.args[0] if name == "addmm" else None)
    if isinstance(bias, torch.fx.Node) and bias.op == "get_attr" and meta.SHAPE.has(bias):
        return meta.SHAPE.get(bias).nbytes
    return 0


@dataclass(frozen=True)
class _Reached:
    """What flows from a linear's output before another linear reads it: the ops on the
    way, the linears reached, and whether it reaches the graph's output."""

    inside: frozenset[torch.fx.Node]
    frontier: frozenset[torch.fx.Node]
    output: bool


def _reach(start: torch.fx.Node, linears: dict[torch.fx.Node, tuple[int, int]]
           ) -> _Reached | None:
    """``_Reached`` from ``start``; None where it spreads past ``REGION_CAP`` ops (the
    model's main stream). Shape reads (``size``, ``dtype``) are not values it flows into."""
    inside: set[torch.fx.Node] = set()
    frontier: set[torch.fx.Node] = set()
    output = False
    todo = [start]
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                output = True
            elif user in linears:
                frontier.add(user)
            elif user not in inside and user.op in OP_NODES and _is_tensor(user):
                inside.add(user)
                if len(inside) > REGION_CAP:
                    return None
                todo.append(user)
    return _Reached(frozenset(inside), frozenset(frontier), output)


def _pairs(linears: dict[torch.fx.Node, tuple[int, int]],
           reach: dict[torch.fx.Node, _Reached | None]
           ) -> list[tuple[torch.fx.Node, list[torch.fx.Node], set[torch.fx.Node], int]]:
    """(row, columns, the ops between them, units) of every pair, in graph order: each
    column's flow ends at one linear, which reduces back to the column's input width and
    reads what flows from the columns; a linear is in one pair at most (the first)."""
    columns_of: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node, (_, width) in linears.items():
        found = reach[node]
        if found is None or found.output or len(found.frontier) != 1:
            continue
        (row,) = found.frontier
        if linears[row][0] == width:
            columns_of.setdefault(row, []).append(node)
    used: set[torch.fx.Node] = set()
    pairs = []
    for row, columns in columns_of.items():
        inside = set().union(*(reach[c].inside for c in columns))  # type: ignore[union-attr]
        activation = next((a for a in row.all_input_nodes if a.op != "get_attr"), None)
        if used & {row, *columns} or activation not in inside | set(columns):
            continue
        used.update({row, *columns})
        pairs.append((row, columns, inside, _units(columns, inside, linears)))
    return pairs


def _attention(columns: list[torch.fx.Node], inside: set[torch.fx.Node]
               ) -> tuple[int, int] | None:
    """(heads, head width) of the first attention among ``inside``: torch's attention
    call's query, or a matmul of two values of the pair (q @ k^T), shaped (..., heads,
    tokens, head width)."""
    flowing = inside | set(columns)
    for node in sorted(inside):  # graph order
        name = op_name(node.target)
        values = [a for a in node.all_input_nodes if a in flowing]
        if _ATTENTION in name or (name in _MATMULS and len(values) == 2):
            query = meta.SHAPE.get(node.all_input_nodes[0]).tensors[0].shape
            if len(query) >= 3:
                return query[-3], query[-1]
    return None


def _units(columns: list[torch.fx.Node], inside: set[torch.fx.Node],
           linears: dict[torch.fx.Node, tuple[int, int]]) -> int:
    """What a TP degree must divide for this pair: with attention, the heads and every
    column's heads (a k or v projection's KV heads; a fused qkv's 3 x heads); else the
    columns' widths (an MLP's hidden width)."""
    found = _attention(columns, inside)
    widths = [linears[c][0] for c in columns]
    if found is None:
        return math.gcd(*widths)
    heads, width = found
    return math.gcd(heads, *(w // width for w in widths if w % width == 0))


def _pair(row: torch.fx.Node, columns: list[torch.fx.Node], inside: set[torch.fx.Node],
          units: int) -> Pair:
    found = _attention(columns, inside)
    paths = [meta.MODULE.get(n).path.split(".") for n in (*columns, row)]
    common = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    module = ".".join(common) or meta.MODULE.get(row).path
    if found is None:
        return Pair(row.name, tuple(c.name for c in columns), module, units=units)
    heads, width = found
    per_column = [meta.SHAPE.get(c).tensors[0].shape[-1] // width for c in columns]
    return Pair(row.name, tuple(c.name for c in columns), module, heads,
                min(heads, *per_column), units)


def linear_features(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[int, int] | None:
    """(out, in) features of a linear op with a weight of the model: an ``nn.Linear`` call,
    or ``linear`` / ``addmm`` / ``mm`` reading a ``get_attr`` weight (transposed, for
    ``addmm`` and ``mm``, as torch.export writes ``x @ w.t()``); None for another op."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return (module.out_features, module.in_features) if isinstance(
            module, torch.nn.Linear) else None
    if node.op != "call_function":
        return None
    name = op_name(node.target)
    if name == "linear" and len(node.args) > 1:
        shape = _weight_shape(node.args[1])
        return (shape[0], shape[1]) if shape is not None else None
    if name in ("addmm", "mm") and node.args:
        weight = node.args[-1]
        if isinstance(weight, torch.fx.Node) and weight.op == "get_attr":
            shape = _weight_shape(weight)  # (in, out): x @ w
            return (shape[1], shape[0]) if shape is not None else None
        if (isinstance(weight, torch.fx.Node) and op_name(weight.target) in ("t", "transpose",
                                                                            "permute")
                and weight.args):
            shape = _weight_shape(weight.args[0])  # (out, in): x @ w.t()
            return (shape[0], shape[1]) if shape is not None else None
    return None


def embedding_rows(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int | None:
    """The rows of an embedding lookup's table (an ``nn.Embedding`` call, or ``embedding``
    reading a ``get_attr`` table); None for another op."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return module.num_embeddings if isinstance(module, torch.nn.Embedding) else None
    if node.op != "call_function" or op_name(node.target) != "embedding":
        return None
    table = next((a for a in node.all_input_nodes if a.op == "get_attr"), None)
    shape = _weight_shape(table) if table is not None else None
    return shape[0] if shape is not None else None


def _weight_shape(arg: object) -> tuple[int, ...] | None:
    """The shape of a 2-D ``get_attr`` value; None for anything else."""
    if not isinstance(arg, torch.fx.Node) or arg.op != "get_attr" or not meta.SHAPE.has(arg):
        return None
    tensors = meta.SHAPE.get(arg).tensors
    return tensors[0].shape if len(tensors) == 1 and len(tensors[0].shape) == 2 else None


def _replicated(ops: list[torch.fx.Node]) -> tuple[str, ...]:
    """The modules of the replicated ops that read parameters, layer numbers as ``*``."""
    found = []
    for node in ops:
        if meta.SHARD.get(node).role != "replicated":
            continue
        params = meta.BYTES.get(node).params or any(
            meta.BYTES.get(s).params for s in node.all_input_nodes if s.op == "get_attr")
        if params:
            found.append(layer_pattern(meta.MODULE.get(node).path or "(the model)"))
    return tuple(dict.fromkeys(found))


def layer_pattern(path: str) -> str:
    """``layers.3.attn_norm`` as ``layers.*.attn_norm``: one name for every layer's."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", path)


def op_name(target: object) -> str:
    """An op's name: aten's overload packet's (``linear`` of ``aten.linear.default``), a
    function's or a method's."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return str(packet.__name__)
    return target if isinstance(target, str) else str(getattr(target, "__name__", ""))


def _is_tensor(node: torch.fx.Node) -> bool:
    return meta.SHAPE.has(node) and bool(meta.SHAPE.get(node).tensors)
