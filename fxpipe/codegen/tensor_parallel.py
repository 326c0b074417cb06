"""The ``TENSOR_PARALLEL`` table of a plan that splits each stage over t GPUs of a host:
per stage, which parameters split along which dim (``runtime/tensor_parallel.py`` makes
them DTensors so), read off each op's ``meta.SHARD`` role
(``passes/tensor_parallel.py``).

A linear's weight is (out, in) as ``nn.Linear`` and ``aten.linear`` hold it, or (in, out)
where torch.export wrote ``x @ w`` (``addmm`` / ``mm`` on the weight itself): a column-
parallel linear and a vocabulary-parallel LM head split its out features (and their
bias), a row-parallel one its in features (its bias, added once to the sum, stays
whole); a vocabulary-parallel embedding splits its table's rows where its lookups have
one reader, else its width: torch's DTensor sums each GPU's share of a row-split lookup
when it is first read and fails on a second reader (torch 2.13's ``_MaskPartial`` keeps
its mask for one reduction), while a width-split lookup is gathered where read. A
parameter claimed along two dims (read by two ops that split it differently, or tied to
one that does) stays whole: DTensor runs any placement exactly, only the collectives
differ.

Which pairs a stage runs on each rank's local share (``stage_local_pairs``): those
``codegen/local_shards.py`` can follow whose weights all split as Megatron's; the columns
of such a pair that a split cuts into parts (a fused qkv) are written ``(dim, parts)``,
which the runtime lays out per rank as [q_r | k_r | v_r].
"""

from __future__ import annotations

import json

import torch.fx

from fxpipe import meta
from fxpipe.codegen.local_shards import LocalPair, LocalStage, Tokens, draws, local_pairs
from fxpipe.codegen.stages import wrap_line
from fxpipe.cut import StageIO
from fxpipe.passes.base import OP_NODES
from fxpipe.passes.sequence_parallel import Gap, sequence_gaps
from fxpipe.passes.tensor_parallel import annotate_tensor_parallel, embedding_rows, op_name
from fxpipe.plan import Plan

__all__ = ["claims", "parameter_splits", "stage_local_pairs", "tensor_parallel_lines",
           "whole_pairs"]

# the dim of an (out, in) weight each role splits: rows (out features) or columns (in)
_OUT, _IN = 0, 1
_WEIGHT_DIM = {"column": _OUT, "vocab_head": _OUT, "row": _IN, "vocab_embedding": _OUT}
# ops that carry a row-split lookup's unsummed shares on (DTensor's partial placement)
_CARRY = frozenset({"to", "_to_copy", "type_as", "float", "double", "half", "bfloat16",
                    "view", "reshape", "_unsafe_view", "contiguous", "clone", "alias",
                    "detach", "dropout", "mul", "div", "neg", "truediv"})


def tensor_parallel_lines(gm: torch.fx.GraphModule, plan: Plan, ios: list[StageIO],
                          tied: list[dict[int, str]], pairs: list[LocalStage]) -> list[str]:
    """The ``TENSOR_PARALLEL`` lines of ``distributed.py`` (none where the plan's layout
    has t = 1, so that such a package reads as before tensor parallelism); ``pairs``: what
    the stages run split (``stage_local_pairs``, worked out once for the stages' code)."""
    layout = plan.layout
    if layout is None or layout.tp == 1:
        return []
    splits = parameter_splits(gm, ios, tied)
    by_name = {n.name: n for n in gm.graph.nodes}
    lines = [
        "# TENSOR_PARALLEL: (t, per stage the parameters split over its t GPUs of a host and",
        "# the dim each splits along, or (the dim, the sizes of the parts laid along it: a",
        "# fused qkv's q, k and v, each GPU holding its share of each)); the rest of each",
        "# stage is whole on every one of them",
        f"TENSOR_PARALLEL = ({layout.tp}, (",
    ]
    for j, split in enumerate(splits):
        parts = {param: parts for pair in pairs[j].pairs for column, parts in pair.fused.items()
                 for param, _ in claims(gm, by_name[column])}
        table = {name: (dim, parts[name]) if name in parts else dim
                 for name, dim in split.items()}
        lines.append(f"    # stage {j}")
        items = ", ".join(f"{json.dumps(name)}: {value}" for name, value in table.items())
        lines += wrap_line(f"    {{{items}}},") if len(items) < 80 else [
            "    {", *(f"        {json.dumps(name)}: {value}," for name, value in table.items()),
            "    },"]
    lines.append("))")
    return lines + _whole_pairs(gm, ios, pairs)


def whole_pairs(gm: torch.fx.GraphModule, ios: list[StageIO],
                pairs: list[LocalStage]) -> list[str]:
    """The pairs (their row op's module, or name) each GPU of a stage runs whole, on
    DTensors with global shapes, though the plan divides them."""
    by_name = {n.name: n for n in gm.graph.nodes}
    local = {pair.row for stage in pairs for pair in stage.pairs}
    return [meta.MODULE.get(by_name[name]).path or name for io in ios for name in io.nodes
            if meta.SHARD.has(by_name[name]) and meta.SHARD.get(by_name[name]).role == "row"
            and name not in local]


def _whole_pairs(gm: torch.fx.GraphModule, ios: list[StageIO],
                 pairs: list[LocalStage]) -> list[str]:
    """A comment naming the pairs each GPU runs whole (``whole_pairs``): none where every
    pair runs on local shares."""
    whole = whole_pairs(gm, ios, pairs)
    if not whole:
        return []
    return ["# pairs run whole on every GPU of a stage (ops between them the stage code",
            "# cannot split on local shares): correct, though the plan divides their work",
            *_comment_lines(whole)]


def _comment_lines(words: list[str], limit: int = 88) -> list[str]:
    """``words`` comma-separated on comment lines of at most ``limit`` columns."""
    lines = ["#"]
    for i, word in enumerate(words):
        word += "," if i < len(words) - 1 else ""
        if len(lines[-1]) + 1 + len(word) > limit and lines[-1] != "#":
            lines.append("#")
        lines[-1] += " " + word
    return lines


def stage_local_pairs(gm: torch.fx.GraphModule, ios: list[StageIO],
                      tied: list[dict[int, str]], t: int,
                      splits: list[dict[str, int]] | None = None) -> list[LocalStage]:
    """Per stage, what it runs split (``codegen/local_shards.py``): the pairs on local
    shares, those whose weights split as Megatron's, the columns' along their out features
    and the row's along its in features (a weight another op or a tie claims otherwise
    stays whole, and so does its pair); and the embedding lookups split by width, which
    it gathers whole where they are made."""
    if t == 1:
        return [LocalStage() for _ in ios]
    splits = splits if splits is not None else parameter_splits(gm, ios, tied)
    by_name = {n.name: n for n in gm.graph.nodes}

    def megatron(pair: LocalPair, split: dict[str, int]) -> bool:
        return all((found := claims(gm, by_name[name])) and all(
            split.get(param) == dim for param, dim in found)
            for name in (*pair.columns, pair.row))

    def by_width(node: torch.fx.Node, split: dict[str, int]) -> bool:
        return meta.SHARD.has(node) and meta.SHARD.get(node).role == "vocab_embedding" and all(
            split.get(param) == dim == _IN for param, dim in claims(gm, node))

    gaps = sequence_gaps(gm).at(t)
    stages = []
    for io, split in zip(ios, splits, strict=True):
        pairs = tuple(pair for pair in local_pairs(gm, io, t) if megatron(pair, split))
        stages.append(LocalStage(
            pairs, tuple(name for name in io.nodes if by_width(by_name[name], split)),
            _tokens(gm, io, {pair.row for pair in pairs}, gaps)))
    return stages


def _tokens(gm: torch.fx.GraphModule, io: StageIO, rows: set[str], gaps: tuple[Gap, ...]
            ) -> Tokens:
    """What stage ``io`` runs on each rank's share of the tokens: the ops of ``gaps`` it
    runs, the rows among ``rows`` (its pairs on local shares) whose sums enter them, what
    they read from outside and what is read of them outside (``local_shards.Tokens``)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    here = set(io.nodes)
    ops: dict[str, int] = {}
    scattered: dict[str, int] = {}
    for gap in gaps:
        ops.update({name: gap.dim for name in gap.ops if name in here})
        scattered.update({name: gap.dim for name in gap.rows if name in rows})
    made = set(ops) | set(scattered)
    entering = {a.name: ops[name] for name in ops for a in by_name[name].all_input_nodes
                if a.name not in made and _tokens_of(a) == _tokens_of(by_name[name])}
    leaving = tuple(name for name in (*scattered, *ops) if any(  # size reads stay
        u.name in here and u.name not in ops and _tokens_of(u) is not None
        for u in by_name[name].users))
    random = tuple(name for name in ops if draws(gm, by_name[name]))
    return Tokens(ops, scattered, entering, leaving, random)


def _tokens_of(node: torch.fx.Node) -> tuple[int, ...] | None:
    """The dims of a value before its last (its batch and tokens); None for another."""
    if not meta.SHAPE.has(node) or len(meta.SHAPE.get(node).tensors) != 1:
        return None
    return tuple(meta.SHAPE.get(node).tensors[0].shape[:-1])


def parameter_splits(gm: torch.fx.GraphModule, ios: list[StageIO],
                     tied: list[dict[int, str]]) -> list[dict[str, int]]:
    """Per stage, the parameters (by the names the stage binds) split over the TP ranks
    and the dim of each, in name order."""
    if any(not meta.SHARD.has(n) for n in gm.graph.nodes if n.op in OP_NODES):
        annotate_tensor_parallel(gm)
    by_node = {n.name: n for n in gm.graph.nodes}
    claimed: dict[str, set[int]] = {}  # parameter -> the dims ops split it along
    bound: list[set[str]] = []  # per stage, the parameters it binds
    for io in ios:
        nodes = [by_node[name] for name in io.nodes]
        bound.append({name for node in nodes for name in _parameters(gm, node)})
        for node in nodes:
            if node.op in OP_NODES:
                for param, dim in claims(gm, node):
                    claimed.setdefault(param, set()).add(dim)
    split = {name: dims for name, dims in claimed.items() if len(dims) == 1}
    for group in tied:  # a tied parameter splits only as every one of its names does
        if len({frozenset(split.get(name, ())) for name in group.values()}) > 1:
            for name in group.values():
                split.pop(name, None)
    return [{name: next(iter(split[name])) for name in sorted(names) if name in split}
            for names in bound]


def _parameters(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[str]:
    """The names of the parameters ``node`` reads directly (a module call's own, or a
    ``get_attr``'s)."""
    if node.op == "call_module":
        return [name for name, _ in gm.get_submodule(str(node.target)).named_parameters(
            str(node.target), remove_duplicate=False)]
    if node.op == "get_attr":
        return [str(node.target)]
    return []


def claims(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[tuple[str, int]]:
    """(parameter, dim) for each parameter ``node`` splits as its role says."""
    role = meta.SHARD.get(node).role
    dim = _WEIGHT_DIM.get(role)
    if role == "vocab_embedding" and _read_twice(node):
        dim = _IN  # split by width (see the module's docstring)
    if dim is None:
        return []
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        found = [(f"{node.target}.weight", dim)]
        if getattr(module, "bias", None) is not None and dim == _OUT:
            found.append((f"{node.target}.bias", _OUT))
        return found
    if embedding_rows(gm, node) is not None:
        table = next(a for a in node.all_input_nodes if a.op == "get_attr")
        return [(str(table.target), dim)]
    return _function_claims(node, dim)


def _read_twice(node: torch.fx.Node) -> bool:
    """Whether an embedding's lookups reach two readers before an op sums the GPUs'
    shares: through casts, views and scalings (which DTensor lets carry the shares on),
    any node with more than one user."""
    while len(node.users) == 1:
        (node,) = node.users
        if node.op == "output" or op_name(node.target) not in _CARRY:
            return False
    return len(node.users) > 1


def _function_claims(node: torch.fx.Node, dim: int) -> list[tuple[str, int]]:
    """``linear(x, w, b)``, ``addmm(b, x, w)`` or ``mm(x, w)``, w a ``get_attr`` weight
    or its transpose (``t``, ``transpose``, ``permute``)."""
    name = op_name(node.target)
    if name == "linear":
        weight, bias = node.args[1], node.args[2] if len(node.args) > 2 else None
        transposed = False
    else:
        weight, bias = node.args[-1], node.args[0] if name == "addmm" else None
        transposed = True  # x @ w: w is (in, out)
        if isinstance(weight, torch.fx.Node) and weight.op != "get_attr" and weight.args:
            weight, transposed = weight.args[0], False  # x @ w.t(): w is (out, in)
    found = []
    if isinstance(weight, torch.fx.Node) and weight.op == "get_attr":
        found.append((str(weight.target), 1 - dim if transposed else dim))
    if isinstance(bias, torch.fx.Node) and bias.op == "get_attr" and dim == _OUT:
        found.append((str(bias.target), 0))
    return found
