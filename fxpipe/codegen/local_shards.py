"""Stages written for t GPUs: between a column-parallel op and its row-parallel partner
each rank computes only its share (heads / t, ffn / t) on plain tensors of local sizes.

# t: the TP degree; d: the dim of a value that is split over the t ranks.

Why not DTensors all the way: a DTensor keeps the model's global shapes, so the sizes a
stage writes (``split(128, dim=2)``, ``view(b, s, 4, 32)``) hold, but a fused qkv's output
reaches ``split`` along its split dim, where DTensor must gather it: attention would run
whole on every rank, and the plan (which divides it by t) would not be what runs. So a
pair runs as Megatron-LM runs it::

    x (replicated DTensor) ─► column op ─► tp_share ─► plain ops on the local share ─►
        tp_joined (a Shard DTensor) ─► row op (partial sums) ─► tp_replicated (all-reduce)

``tp_share`` takes this rank's columns of the column op's output (``to_local``),
``tp_whole`` the replicated values the ops between read (a mask, rotary cos and sin),
``tp_joined`` makes the local share the DTensor it is a shard of again (``from_local``,
``Shard(d)``), and ``tp_replicated`` all-reduces the row's partial sums where it makes
them, as the plan prices the pair (DTensor's ``redistribute``, never a hand-written
collective; left alone, DTensor may reduce-scatter them into a residual stream that then
stays split by width). A token embedding split by width (``codegen/tensor_parallel.py``)
is gathered whole where it is looked up, for the same reason.

The sizes along d the ops between write become ``local_128 = 128 // tp`` (``self.tp``, 1
where the stage runs whole), found by following d from the column's last dim through
views, transposes, splits, expands and attention.

A random op between (a dropout on this rank's heads, attention's ``dropout_p``) draws
from this rank's own state: ``tp_own_random`` on its input and ``tp_shared_random`` on
its output (``runtime/tp_random.py``), so that each rank's mask is its own, as the
unsplit model's differs from head to head.

Between the pairs, the ops per token (residual adds, norms, dropout:
``passes/sequence_parallel.py``'s gaps) run on each rank's share of the tokens
(``Tokens``): a row's partial sums reduce-scattered along them (``tp_tokens`` instead of
``tp_replicated``), what those ops read from outside cut to this rank's tokens
(``tp_tokens``), and what ops outside read of them gathered whole (``tp_replicated``)::

    row ─► tp_tokens (reduce-scatter) ─► add, norm on tokens / t ─► tp_replicated
        (all-gather) ─► the next column

A fused column (one linear whose out features are [q | k | v], split along d into parts)
is laid out per rank as [q_r | k_r | v_r]: its parts go into the ``TENSOR_PARALLEL``
table (``codegen/tensor_parallel.py``) and ``runtime/tensor_parallel.py`` reorders the
weight's rows (and the bias) when it splits them.

A pair runs split only where every op between is one whose split d is known (a list
below), all of it is in one stage, and its weights split as Megatron's (a tied or twice
claimed weight stays whole); any other pair runs as before, on global DTensors: correct,
though its attention is then whole on every rank.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from fxpipe import meta
from fxpipe.cut import StageIO
from fxpipe.passes.tensor_parallel import op_name

__all__ = ["HELPERS", "LocalPair", "LocalStage", "Tokens", "draws", "local_pairs",
           "local_shape", "write_local"]

# shape-keeping ops whose every element depends on the same elements of its inputs
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "truediv", "neg", "pow", "exp", "sqrt", "rsqrt", "tanh",
    "sigmoid", "relu", "gelu", "silu", "erf", "cos", "sin", "masked_fill", "where",
    "dropout", "to", "_to_copy", "type_as", "float", "double", "half", "bfloat16",
    "contiguous", "clone", "detach", "alias", "invert", "lift_fresh_copy",
})
_MODULES = (torch.nn.GELU, torch.nn.ReLU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid,
            torch.nn.Dropout, torch.nn.Identity)
_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten"})
_SIZED = frozenset({"view", "reshape", "_unsafe_view"})  # their sizes are arguments
_SPLITS = frozenset({"split", "split_with_sizes", "chunk"})
_MATMULS = frozenset({"matmul", "bmm"})
# ops along one dim (their ``dim`` argument), which must not be the split one
_ALONG = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "slice", "cat"})

# the runtime's functions a stage's local code calls, which it imports from ``.runtime``
# (``fxpipe.runtime.tensor_parallel``, imported only where a stage calls them: it loads
# torch's DTensor, which a plan at t = 1 never needs)
HELPERS = ("tp_joined", "tp_own_random", "tp_replicated", "tp_share", "tp_shared_random",
           "tp_tokens", "tp_whole")
# ops that draw random numbers (a dropout's mask): on a share, each rank draws its own
# (``runtime/tp_random.py``)
_RANDOM = frozenset({"dropout", "native_dropout", "alpha_dropout", "feature_alpha_dropout",
                     "feature_dropout", "dropout1d", "dropout2d", "dropout3d", "bernoulli",
                     "rand_like", "randn_like", "randint_like"})

# where in a node's arguments a size is: ("args", i) or ("args", i, j) (item j of a list)
Where = tuple[str, int] | tuple[str, int, int]


@dataclass(frozen=True)
class LocalPair:
    """A pair that runs on local shares: its nodes (by name), the split dim of each value
    between, the sizes along it written in its ops, and the parts of its fused columns."""

    row: str
    columns: tuple[str, ...]
    inside: tuple[str, ...]
    dims: Mapping[str, int]
    sizes: tuple[tuple[str, Where, int], ...]  # (node, where, the whole size)
    joined: tuple[str, int]  # the row's input from the pair, and its split dim
    fused: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    random: tuple[str, ...] = ()  # its ops between that draw random numbers (a dropout)


@dataclass(frozen=True)
class LocalStage:
    """What a stage written for t GPUs runs split: its pairs on local shares, the
    width-split embedding lookups it gathers whole where they are made
    (``tp_replicated``), and the ops between its pairs it runs on its share of the
    tokens (``Tokens``)."""

    pairs: tuple[LocalPair, ...] = ()
    gathered: tuple[str, ...] = ()
    tokens: Tokens = field(default_factory=lambda: Tokens())


@dataclass(frozen=True)
class Tokens:
    """What a stage runs on each rank's share of the tokens (sequence parallelism,
    ``passes/sequence_parallel.py``): the ops per token between pairs (by name, with the
    token dim their values split along), the rows whose partial sums are reduce-scattered
    along it, the values cut to this rank's tokens where those ops read them from
    outside (the embedding's output, a value received whole), the values gathered whole
    where ops outside read them (the next columns), and the random ops among them."""

    ops: Mapping[str, int] = field(default_factory=dict)
    scattered: Mapping[str, int] = field(default_factory=dict)
    entering: Mapping[str, int] = field(default_factory=dict)
    leaving: tuple[str, ...] = ()
    random: tuple[str, ...] = ()


def local_pairs(gm: torch.fx.GraphModule, io: StageIO, t: int) -> list[LocalPair]:
    """The pairs of stage ``io`` whose ops between have known split dims at degree ``t``,
    in graph order (needs ``meta.SHARD``); whether their weights split as Megatron's is
    ``codegen/tensor_parallel.py``'s to say."""
    by_name = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[str, list[torch.fx.Node]] = {}
    for node in (by_name[name] for name in io.nodes):
        if meta.SHARD.has(node) and meta.SHARD.get(node).role in ("column", "inside", "row"):
            groups.setdefault(meta.SHARD.get(node).group, []).append(node)
    outputs = set(io.outputs)
    found = []
    for members in groups.values():
        pair = _local_pair(gm, members, order, t)
        if pair is not None and not outputs & {*pair.columns, *pair.inside}:
            found.append(pair)
    return found


def write_local(sub: torch.fx.Graph, local: LocalStage,
                is_tensor: Callable[[str], bool]) -> None:
    """Rewrite stage graph ``sub`` so that ``local.pairs`` run on local shares (the
    module's docstring): the columns' outputs through ``tp_share``, the values the ops
    between read from outside through ``tp_whole`` (``is_tensor``: whether a node of the
    model's graph, by name, is a tensor), the sizes along the split dim as
    ``local_N = N // tp``, the row's input through ``tp_joined``; and ``local.gathered``
    through ``tp_replicated``."""
    from fxpipe.runtime.tensor_parallel import (
        tp_joined,
        tp_replicated,
        tp_share,
        tp_tokens,
        tp_whole,
    )
    from fxpipe.runtime.tp_random import tp_own_random, tp_shared_random

    nodes = {n.name: n for n in sub.nodes}
    for name in local.gathered:
        lookup = nodes[name]
        with sub.inserting_after(lookup):
            gathered = sub.create_node("call_function", tp_replicated, (lookup,),
                                       name=f"{name}_gathered")
        lookup.replace_all_uses_with(gathered,
                                     delete_user_cb=lambda user, g=gathered: user is not g)
    pairs = local.pairs
    if not pairs and not local.tokens.ops:
        return
    first = next(n for n in sub.nodes if n.op != "placeholder")
    with sub.inserting_before(first):
        tp = sub.create_node("get_attr", "tp", name="tp")
        mesh = sub.create_node("get_attr", "tp_mesh", name="tp_mesh")
    shares_of: dict[int, torch.fx.Node] = {}  # a whole size -> its local share
    whole: dict[torch.fx.Node, torch.fx.Node] = {}  # an outside value -> its plain one
    for pair in pairs:
        shares = set()
        for name in pair.columns:
            column = nodes[name]
            with sub.inserting_after(column):
                share = sub.create_node("call_function", tp_share, (column,),
                                        name=f"{name}_share")
            column.replace_all_uses_with(share, delete_user_cb=lambda user, s=share: user is not s)
            shares.add(share)
        between = {nodes[name] for name in pair.inside} | shares
        for name in pair.inside:
            node = nodes[name]
            for arg in node.all_input_nodes:
                if arg in between or arg in (tp, mesh):
                    continue
                if arg.op == "get_attr" or (arg.name in nodes and is_tensor(arg.name)):
                    if arg not in whole:
                        with sub.inserting_before(node):
                            whole[arg] = sub.create_node("call_function", tp_whole, (arg,),
                                                         name=f"{arg.name}_whole")
                    node.replace_input_with(arg, whole[arg])
        for name, where, size in pair.sizes:
            if size not in shares_of:
                with sub.inserting_after(mesh):
                    shares_of[size] = sub.create_node("call_function", operator.floordiv,
                                                      (size, tp), name=f"local_{size}")
            _set_arg(nodes[name], where, shares_of[size])
        row = nodes[pair.row]
        (value,) = (a for a in row.all_input_nodes if a in between)
        with sub.inserting_before(row):
            joined = sub.create_node("call_function", tp_joined, (value, pair.joined[1], mesh),
                                     name=f"{value.name}_joined")
        row.replace_input_with(value, joined)
        dim = local.tokens.scattered.get(pair.row)
        if dim is None:
            _summed(sub, row, tp_replicated)
        else:  # its sums reduce-scattered along the tokens
            _summed(sub, row, tp_tokens, dim)
        for name in pair.random:
            _own_random(sub, nodes[name], mesh, tp_own_random, tp_shared_random)
    _by_tokens(sub, local.tokens, mesh, (tp_tokens, tp_replicated),
               (tp_own_random, tp_shared_random))


def _by_tokens(sub: torch.fx.Graph, tokens: Tokens, mesh: torch.fx.Node,
               split: tuple[Callable[..., object], Callable[..., object]],
               random: tuple[Callable[..., object], Callable[..., object]]) -> None:
    """The ops per token between pairs on this rank's tokens: what they read from outside
    cut to its tokens (``tp_tokens``, no collective), what ops outside read of them
    gathered whole (``tp_replicated``: the all-gather that, with the row's
    reduce-scatter, is the pair's all-reduce), their random ops on this rank's own
    state (its tokens' masks its own)."""
    to_tokens, to_whole = split
    nodes = {n.name: n for n in sub.nodes}
    inside = {nodes[name] for name in tokens.ops if name in nodes}
    first = next(n for n in sub.nodes if n.op != "placeholder")
    for name, dim in tokens.entering.items():
        value = nodes.get(f"{name}_gathered", nodes[name])  # a lookup gathered first
        if not any(user in inside for user in value.users):
            continue
        where = sub.inserting_before(first) if value.op == "placeholder" else (
            sub.inserting_after(value))
        with where:
            cut = sub.create_node("call_function", to_tokens, (value, dim),
                                  name=f"{name}_tokens")
        value.replace_all_uses_with(cut, delete_user_cb=lambda user: user in inside)
    for name in tokens.leaving:
        value = nodes[f"{name}_sum" if name in tokens.scattered else name]
        users = [u for u in value.users if u not in inside and u.op != "output"]
        if not users:
            continue
        with sub.inserting_after(value):
            whole = sub.create_node("call_function", to_whole, (value,), name=f"{name}_whole")
        value.replace_all_uses_with(whole, delete_user_cb=lambda user, u=users: user in u)
    for name in tokens.random:
        _own_random(sub, nodes[name], mesh, *random)


def _own_random(sub: torch.fx.Graph, op: torch.fx.Node, mesh: torch.fx.Node,
                own: Callable[..., object], shared: Callable[..., object]) -> None:
    """A random op on a share (a dropout on this rank's heads) drawing from this rank's
    own state (``tp_own_random`` on its input), the shared one back after it
    (``tp_shared_random`` on its output): each rank's mask its own, as the unsplit
    model's differs from head to head."""
    value = op.all_input_nodes[0]
    with sub.inserting_before(op):
        entered = sub.create_node("call_function", own, (value, mesh),
                                  name=f"{value.name}_own_random")
    op.replace_input_with(value, entered)
    with sub.inserting_after(op):
        left = sub.create_node("call_function", shared, (op, mesh),
                               name=f"{op.name}_shared_random")
    op.replace_all_uses_with(left, delete_user_cb=lambda user: user is not left)


def _summed(sub: torch.fx.Graph, row: torch.fx.Node, tp_replicated: Callable[..., object],
            *dim: int) -> None:
    """The row's partial sums all-reduced where it makes them (``tp_replicated``), as the
    plan prices the pair: else torch's sharding rules may reduce-scatter them into the
    residual stream, which then stays split by width, gathered at every norm (a stage's
    output is made whole where it leaves); or, with ``dim``, reduce-scattered along that
    token dim (``tp_tokens``: sequence parallelism)."""
    with sub.inserting_after(row):
        summed = sub.create_node("call_function", tp_replicated, (row, *dim),
                                 name=f"{row.name}_sum")
    row.replace_all_uses_with(
        summed, delete_user_cb=lambda user: user is not summed and user.op != "output")


def local_shape(tensors: Sequence[meta.TensorSpec], dim: int) -> str:
    """The shape comment of a value split along ``dim``: ``float64[2, 4 / tp, 64, 32]``
    (none for several tensors)."""
    if len(tensors) != 1:
        return ""
    dims = (f"{size} / tp" if k == dim else str(size) for k, size in enumerate(tensors[0].shape))
    return f"{tensors[0].dtype}[{', '.join(dims)}]"


def _set_arg(node: torch.fx.Node, where: Where, value: torch.fx.Node) -> None:
    """Put ``value`` at ``where`` in ``node``'s arguments (an item of a list keeps its list)."""
    position = where[1]
    if len(where) == 2:
        node.update_arg(position, value)
        return
    items = node.args[position]
    assert isinstance(items, (list, tuple)), items
    changed = [value if j == where[2] else item for j, item in enumerate(items)]
    node.update_arg(position, changed if isinstance(items, list) else tuple(changed))


def _local_pair(gm: torch.fx.GraphModule, members: list[torch.fx.Node],
                order: Mapping[torch.fx.Node, int], t: int) -> LocalPair | None:
    """The pair of ``members`` (one group's nodes) with its split dims; None where an op
    between is not one whose split dim is known."""
    roles = {n: meta.SHARD.get(n).role for n in members}
    rows = [n for n in members if roles[n] == "row"]
    columns = [n for n in members if roles[n] == "column"]
    inside = sorted((n for n in members if roles[n] == "inside"), key=order.__getitem__)
    if len(rows) != 1 or not columns:
        return None
    (row,) = rows
    dims: dict[torch.fx.Node, int] = {c: len(_shape(c)) - 1 for c in columns}
    sizes: list[tuple[str, Where, int]] = []
    fused: dict[str, tuple[int, ...]] = {}
    for node in inside:
        if not _is_tensor_op(node):
            return None
        dim = _follow(gm, node, dims, sizes, fused, t)
        if dim is None:
            return None
        dims[node] = dim
    activation = next((a for a in row.all_input_nodes if a.op != "get_attr"), None)
    if activation not in dims or any(a in dims for a in row.all_input_nodes
                                     if a is not activation):
        return None
    assert activation is not None
    return LocalPair(row.name, tuple(c.name for c in columns), tuple(n.name for n in inside),
                     {n.name: d for n, d in dims.items()}, tuple(sizes),
                     (activation.name, dims[activation]), fused,
                     tuple(n.name for n in inside if draws(gm, n)))


def _follow(gm: torch.fx.GraphModule, node: torch.fx.Node, dims: dict[torch.fx.Node, int],
            sizes: list[tuple[str, Where, int]], fused: dict[str, tuple[int, ...]],
            t: int) -> int | None:
    """The split dim of ``node``'s value, from its inputs' (``dims``); the sizes along it
    it writes go to ``sizes``, a split of a column's parts to ``fused``. None: unknown."""
    split = [a for a in node.all_input_nodes if a in dims]
    if not split:
        return None
    first = split[0]
    d, shape_in = dims[first], _shape(first)
    out = _shape(node)
    name = _name(gm, node)
    if name is None:
        return None
    if node.target is operator.getitem:
        return d if _is_split(gm, first) else None  # an item of a split, not an index
    if name in _SIZED or name in _VIEWS:
        k = _prefix_dim(shape_in, d, out, t)
        if k is None or len(split) > 1:
            return None
        if name in _SIZED and not _size_at(node, k, out[k], sizes, t):
            return None
        return k
    if name == "expand":
        k = d + len(out) - len(shape_in)
        return k if _size_at(node, k, out[k], sizes, t) else None
    if name in ("transpose", "t"):
        a, b = _int_arg(node, 1, "dim0", 0), _int_arg(node, 2, "dim1", 1)
        if a is None or b is None:
            return None
        a, b = a % len(shape_in), b % len(shape_in)
        return b if d == a else a if d == b else d
    if name == "permute":
        perm = [p % len(shape_in) for p in _int_list(node)]
        return perm.index(d) if sorted(perm) == list(range(len(shape_in))) else None
    if name in _SPLITS:
        return _split(gm, node, first, d, shape_in, sizes, fused, t)
    if name in _ALONG:  # an op along one dim: not the split one
        axis = _int_arg(node, 1, "dim", 0)
        if name == "cat" and any(a not in dims for a in node.all_input_nodes):
            return None  # a whole value cut to this rank's share: not followed
        k = _aligned(node, dims)
        return k if axis is not None and k is not None and axis % len(out) != k else None
    if name in _MATMULS:
        k = _aligned(node, dims)
        return k if k is not None and k < len(out) - 2 else None
    if name in _ELEMENTWISE or name == "scaled_dot_product_attention":
        return _aligned(node, dims)
    return None


def _aligned(node: torch.fx.Node, dims: Mapping[torch.fx.Node, int]) -> int | None:
    """The split dim of an op that broadcasts its inputs (aligned at their last dims, as
    attention's query, key and value are): every split input's meets at one dim k of the
    output, of its size, and every other input is 1 there (a mask, cos and sin: whole on
    every rank)."""
    out = _shape(node)
    at = {dims[a] + len(out) - len(_shape(a)) for a in node.all_input_nodes if a in dims}
    if len(at) != 1:
        return None
    (k,) = at
    for arg in node.all_input_nodes:
        if not _is_value(arg):
            continue
        shape = _shape(arg)
        j = k - (len(out) - len(shape))
        if arg in dims and (j < 0 or shape[j] != out[k]):
            return None
        if arg not in dims and j >= 0 and shape[j] != 1:
            return None
    return k if k >= 0 else None


def _split(gm: torch.fx.GraphModule, node: torch.fx.Node, first: torch.fx.Node, d: int,
           shape_in: tuple[int, ...], sizes: list[tuple[str, Where, int]],
           fused: dict[str, tuple[int, ...]], t: int) -> int | None:
    """A split or chunk: along another dim, the split dim stays; along d it cuts a
    column's parts (a fused qkv's q, k, v), each of which must split over t, and its
    sizes become local."""
    axis = _int_arg(node, 2, "dim", 0)
    if axis is None:
        return None
    if axis % len(shape_in) != d:
        return d
    column = _column_of(gm, first)
    how = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size_or_sections")
    whole = shape_in[d]
    if isinstance(how, int) and _name(gm, node) == "chunk":
        parts = (whole // how,) * how if whole % how == 0 else ()
    elif isinstance(how, int):
        parts = (how,) * (whole // how) + ((whole % how,) if whole % how else ())
        sizes.append((node.name, ("args", 1), how))
    elif isinstance(how, (list, tuple)) and all(isinstance(p, int) for p in how):
        parts = tuple(how)
        sizes += [(node.name, ("args", 1, j), p) for j, p in enumerate(parts)]
    else:
        return None
    if (column is None or _shape(column)[-1] != whole or not parts or any(p % t for p in parts)
            or sum(parts) != whole):
        return None
    if fused.setdefault(column.name, parts) != parts:
        return None
    return d


def _column_of(gm: torch.fx.GraphModule, value: torch.fx.Node) -> torch.fx.Node | None:
    """The column whose output ``value`` is, through views and elementwise ops: the
    column a split along its split dim cuts into parts."""
    while meta.SHARD.get(value).role != "column":
        inputs = [a for a in value.all_input_nodes if meta.SHARD.has(a)
                  and meta.SHARD.get(a).role in ("column", "inside")]
        if len(inputs) != 1 or _name(gm, value) not in _VIEWS | _ELEMENTWISE:
            return None
        (value,) = inputs
    return value


def _prefix_dim(shape_in: tuple[int, ...], d: int, out: tuple[int, ...], t: int
                ) -> int | None:
    """Where a view puts split dim d: the output dim that starts where d starts (the same
    product of the dims before) and is d's leading factor (d split, as E into heads and
    head width) or d with the dims after it (merged back); its size must split over t."""
    before = math.prod(shape_in[:d])
    product = 1
    for k, size in enumerate(out):
        if product == before and size != 1:
            whole, merged = shape_in[d], 1
            for rest in shape_in[d + 1:]:
                if whole * merged >= size:
                    break
                merged *= rest
            fits = whole % size == 0 or whole * merged == size
            return k if size % t == 0 and fits else None
        product *= size
    return None


def _size_at(node: torch.fx.Node, k: int, whole: int, sizes: list[tuple[str, Where, int]],
             t: int) -> bool:
    """Note the size a view or expand writes for output dim k (the split one): a literal
    becomes local, -1 is inferred locally; a size read from another value cannot be."""
    args = node.args[1:]
    at: Where
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        if k >= len(args[0]):
            return False
        value, at = args[0][k], ("args", 1, k)
    elif k < len(args):
        value, at = args[k], ("args", 1 + k)
    else:
        return False
    if value == -1:
        return True
    if isinstance(value, int) and value == whole and whole % t == 0:
        sizes.append((node.name, at, whole))
        return True
    return False


def draws(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers: a dropout module, a random op, or torch's
    attention with a dropout (its ``dropout_p`` not a literal 0)."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), torch.nn.modules.dropout._DropoutNd)
    name = op_name(node.target)
    if name == "scaled_dot_product_attention":
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return name in _RANDOM


def _is_split(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    return _name(gm, node) in _SPLITS


def _name(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    """The op's name, a parameter-free activation module's as an elementwise op's; None
    for a module with state (its parameters would be whole on split values)."""
    if node.op != "call_module":
        return op_name(node.target)
    module = gm.get_submodule(str(node.target))
    stateful = any(True for _ in module.parameters()) or any(True for _ in module.buffers())
    return None if stateful or not isinstance(module, _MODULES) else "gelu"


def _int_arg(node: torch.fx.Node, position: int, key: str, default: int) -> int | None:
    """An int argument by position or keyword (None where it is another value)."""
    value = node.args[position] if len(node.args) > position else node.kwargs.get(key, default)
    return value if isinstance(value, int) else None


def _int_list(node: torch.fx.Node) -> list[int]:
    args = node.args[1:]
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = tuple(args[0])
    return [a for a in args if isinstance(a, int)]


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(meta.SHAPE.get(node).tensors[0].shape)


def _is_value(node: torch.fx.Node) -> bool:
    return meta.SHAPE.has(node) and len(meta.SHAPE.get(node).tensors) == 1


def _is_tensor_op(node: torch.fx.Node) -> bool:
    return meta.SHAPE.has(node) and bool(meta.SHAPE.get(node).tensors)
