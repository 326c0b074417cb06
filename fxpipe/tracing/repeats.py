"""Exporting a model whose layers repeat: export a few of them, copy the last for the rest.

torch.export spends milliseconds per op on symbolic shapes: 9.6 s of a 10.5 s trace of
a 32-layer Llama-3-8B, 36 s for an 80-layer 70B. The layers of such a model are one
class with one structure, stored in an ``nn.ModuleList``. The model is exported with
each long list cut to its first two layers, and the graph of the second is copied for
the others, each copy reading its own layer's parameters and the previous copy's values
where the second read the first's.

Layers of one structure need not all run alike, and the copy follows how they do
(``Repeat``): where the first layer runs unlike the others (they read its output, say),
three are exported and the third is copied; where they alternate with a period p
(GPT-OSS's and Gemma-2's sliding-window and full attention, every other layer), 2p are
exported and the last p copied in turn, layer i as the exported layer of its phase. A
list may start with a few layers built otherwise (dense feed-forward layers before the
experts, as in DeepSeek-V3 and GLM-4.5): those are exported too, with three alike ones
after them (``first_repeat``).

A copy is only right if every later layer really runs as the copied one does, which
nothing in a model's structure promises. So the whole model's run is recorded first
(``layer_runs.py``), and gives the period and the first layer from which the layers
repeat. The copy is made only when the layers after the exported ones record exactly as
the exported layer of their phase, the cut model records exactly as the whole model's
first layers and everything outside them, and the exported graphs of the last two
periods match node for node (the first layer reading from before the layers what the
one a period later reads from the layer before it); otherwise the whole model is
exported as it is.

The whole model's run, seconds of Python on a long model, and the cut model's are
recorded in a forked child (``forked.py``) while the model cut to two layers, the common
case, is exported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fxpipe import meta
from fxpipe.forked import Forked
from fxpipe.runtime.binding import bind
from fxpipe.tracing.export import export_program, exported_graph
from fxpipe.tracing.layer_runs import (
    Layers,
    Repeat,
    Run,
    cut,
    first_repeat,
    layer_lists,
    record,
    repeat_of,
    same_run,
    worth_copying,
)
from fxpipe.tracing.records import InputShape

__all__ = ["export_in_layers"]

def export_in_layers(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.fx.GraphModule, tuple[Any, ...], tuple[InputShape, ...],
           Exception | None, str] | None:
    """``export_program`` and ``exported_graph`` with each long list of layers exported a
    few deep and copied (the module docstring), and a note saying so; None when the
    model has no such list or its later layers do not run as exported ones."""
    lists = layer_lists(model)
    if not lists:
        return None
    first = first_repeat(lists)
    with Forked(lambda: _runs(model, args, kwargs, lists, first)) as recorded:
        # exported and copied while the child records the whole model and the cut one;
        # kept if those runs show every later layer ran as the copied one
        layered = _layered(model, args, kwargs, lists, first)
        whole, kept = recorded.result()
    if whole is None:
        return None
    if (layered is None or layered.graph is None or kept is None
            or not same_run(whole, kept, lists, first)):
        layered = None
        for repeat in to_try(repeat_of(whole, lists), lists, first):
            layered = _layered(model, args, kwargs, lists, repeat, whole)
            if layered is not None and layered.graph is not None:
                break
    if layered is None or layered.graph is None:
        return None
    shown = ", ".join(
        f"{len(layers.modules)} of {layers.path}"
        + (f", the first {layers.alike_from} built otherwise" if layers.alike_from else "")
        for layers in lists)
    depth, period = layered.repeat.depth, layered.repeat.period
    if period == 1:
        how = f"copied the last for the others: every later layer ran as layer {depth - 1} did"
    else:
        how = (f"copied the last {period} in turn for the others: every later layer ran "
               f"as the one {period} before it did")
    note = f"exported {depth} layers of each list of identical layers ({shown}) and {how}"
    return (*layered.graph, layered.fixed_shapes, note)


def to_try(repeat: Repeat | None, lists: Sequence[Layers], first: Repeat) -> list[Repeat]:
    """After ``first`` (``first_repeat``): the repeat the whole model's run shows, then
    one period deeper (export may write the first layer otherwise than the later ones:
    shape arithmetic it does once, say), each where it is worth copying."""
    if repeat is None:
        return []
    deeper = Repeat(repeat.depth + repeat.period, repeat.period)
    return [r for r in (repeat, deeper) if r != first and worth_copying(r, lists)]


def _runs(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
          lists: Sequence[Layers], first: Repeat) -> tuple[Run | None, Run | None]:
    """The recorded runs of the whole model and of the model cut to ``first`` (None, None
    when the whole model cannot be recorded: nothing is copied then)."""
    whole = record(model, args, kwargs, lists)
    if whole is None:
        return None, None
    with cut(lists, first.depth):
        return whole, record(model, args, kwargs, lists)


@dataclass
class _Layered:
    """The model exported cut to ``repeat.depth`` layers per list: the graph with the
    exported layers copied for the others and its inputs (None where the last two
    exported periods differ), and the error that kept export from free dimensions
    (``export_program``)."""

    repeat: Repeat
    graph: tuple[torch.fx.GraphModule, tuple[Any, ...], tuple[InputShape, ...]] | None
    fixed_shapes: Exception | None


def _layered(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
    lists: Sequence[Layers], repeat: Repeat, whole: Run | None = None,
) -> _Layered | None:
    """The model cut to ``repeat.depth`` layers per list, exported and copied; None where
    it cannot be exported, or, given ``whole``, cannot be recorded or did not run as
    ``whole`` did (without it the caller checks the run: the first repeat's is recorded
    beside the whole model's, ``_runs``)."""
    try:
        with cut(lists, repeat.depth):
            if whole is not None:
                kept = record(model, args, kwargs, lists)
                if kept is None or not same_run(whole, kept, lists, repeat):
                    return None
            program, fixed_shapes = export_program(model, args, kwargs)
    except Exception:
        return None  # the whole model may still export: it is tried next
    gm, flat, inputs = exported_graph(program, args, kwargs)
    copied = all(copy_layers(gm, model, layers, repeat) for layers in lists)
    return _Layered(repeat, (gm, flat, inputs) if copied else None, fixed_shapes)


def copy_layers(gm: torch.fx.GraphModule, model: torch.nn.Module, layers: Layers,
                repeat: Repeat) -> bool:
    """Copy the exported graph's last ``repeat.period`` layers of ``layers``
    (``repeat.depth`` of them exported) in turn for each layer the cut left out, each
    copy reading its own layer's parameters from ``model`` and the copy before it where
    its template read the layer before; False (and ``gm`` is then to be dropped) when the
    graphs of the last two exported periods differ."""
    depth, period = repeat.depth, repeat.period
    members = _members(gm, layers.path)
    if (sorted(members) != list(range(depth))
            or not _same_layers(members, layers.path, depth, period)):
        return False
    templates = {t: members[t] for t in range(depth - period, depth)}
    at = {t: {node: p for p, node in enumerate(nodes)} for t, nodes in templates.items()}
    at_previous = {t: {node: p for p, node in enumerate(members[t - 1])} for t in templates}
    inside = {node for nodes in templates.values() for node in nodes}
    order = {node: p for p, node in enumerate(gm.graph.nodes)}
    readers = {user: None for node in inside for user in node.users if user not in inside}
    last = templates[depth - 1][-1]
    if any(order[user] < order[last] for user in readers):
        return False  # something outside the layers runs inside them: not layers to copy
    if any(node not in at[depth - 1] for user in readers for node in user.all_input_nodes
           if node in inside):
        return False  # only the last layer's values are read after the layers
    attrs = {t: _own_attrs(gm, layers.path, t) for t in templates}
    # A whole export reads every parameter before any buffer: each copy's parameters go
    # after the last parameter read so far, its buffers after the last buffer.
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    read = [n for a in attrs.values() for n in a]
    last_attr = {kind: max((n for n in read if (str(n.target) in params) == kind),
                           key=order.__getitem__, default=None) for kind in (True, False)}
    # The lifted constants (see _members) are copied after the last one, where a whole
    # export has them; the rest after the copy before.
    lifted = [node for nodes in templates.values() for node in nodes
              if not node.meta.get("nn_module_stack")]
    is_lifted = set(lifted)
    before, after = members[depth - 1], last
    after_lifted = max(lifted, key=order.__getitem__) if lifted else None
    for index in range(depth, len(layers.modules)):
        t = repeat.template(index)
        names = _add_attrs(gm, model, f"{layers.path}.{index}.", attrs[t], last_attr, params)

        def source(node: torch.fx.Node, made: list[torch.fx.Node],
                   before: list[torch.fx.Node] = before,
                   names: dict[torch.fx.Node, torch.fx.Node] = names,
                   t: int = t) -> torch.fx.Node:
            if node in at[t]:
                return made[at[t][node]]
            if node in at_previous[t]:
                return before[at_previous[t][node]]
            return names.get(node, node)

        made = _copy(gm, templates[t], after, source, is_lifted, after_lifted)
        for node, copy in zip(templates[t], made, strict=True):
            copy.meta = _moved_meta(node.meta, layers.path, t, index)
            meta.COPY_OF.set(copy, node.name)
        before, after = made, made[-1]
        made_lifted = [copy for node, copy in zip(templates[t], made, strict=True)
                       if node in is_lifted]
        if made_lifted:
            after_lifted = made_lifted[-1]
    for user in readers:  # what read the last exported layer reads the last copy
        for node in user.all_input_nodes:
            if node in at[depth - 1]:
                user.replace_input_with(node, before[at[depth - 1][node]])
    gm.graph.lint()
    gm.recompile()
    return True


def mark_copies(gm: torch.fx.GraphModule, model: torch.nn.Module) -> int:
    """On a graph traced whole (``symbolic_trace``): name each op node of a list's layer a
    copy of the node in the same place of the first layer, from the second on, whose graph
    (``_layer_graph``) it has (``meta.COPY_OF``), so that the passes need not run it again.
    The number of nodes named; the passes check each copy's inputs against its node's
    before they take that node's records. Nothing is named where it fails part way."""
    names: list[tuple[torch.fx.Node, str]] = []
    for layers in layer_lists(model):
        members = _members(gm, layers.path)
        if sorted(members) != list(range(len(layers.modules))):
            continue
        # Each layer's graph against the first of the layers from the second on that has
        # it: a list that starts with layers built otherwise (DeepSeek-V3's dense ones)
        # has its later layers named copies of the first alike one's successor.
        seen: list[tuple[list[tuple[Any, ...]], int]] = []
        for index in range(1, len(layers.modules)):
            graph = _layer_graph(members, layers.path, index)
            first = next((i for g, i in seen if g == graph), None)
            if first is None:
                seen.append((graph, index))
                continue
            names += [(copy, node.name)
                      for node, copy in zip(members[first], members[index], strict=True)
                      if copy.op in ("call_function", "call_method", "call_module")]
    for copy, name in names:
        meta.COPY_OF.set(copy, name)
    return len(names)


def _layer_graph(members: dict[int, list[torch.fx.Node]], path: str, index: int
                 ) -> list[tuple[Any, ...]]:
    """Layer ``index``'s nodes without what tells the layers apart: its own nodes by place,
    the layer before's by place there, its modules and attributes by name inside it."""
    here = {node: p for p, node in enumerate(members[index])}
    before = {node: p for p, node in enumerate(members[index - 1])}
    prefix = f"{path}.{index}."

    def own(node: torch.fx.Node) -> Any:
        target = str(node.target)
        if node.op in ("call_module", "get_attr") and target.startswith(prefix):
            return ("own", target[len(prefix):])
        return node.target

    def kind(node: torch.fx.Node) -> Any:
        if node in here:
            return ("here", here[node])
        if node in before:
            return ("before", before[node])
        return node

    return [(n.op, own(n), torch.fx.map_arg(n.args, kind), torch.fx.map_arg(n.kwargs, kind))
            for n in members[index]]


def _members(gm: torch.fx.GraphModule, path: str) -> dict[int, list[torch.fx.Node]]:
    """The nodes of each exported layer at ``path``, in graph order, by layer index (the
    outermost module on a node's ``nn_module_stack`` inside the list)."""
    pattern = re.compile(re.escape(path) + r"\.(\d+)$")
    members: dict[int, list[torch.fx.Node]] = {}
    index_of: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        for module_path, _ in (node.meta.get("nn_module_stack") or {}).values():
            found = pattern.match(module_path)
            if found:
                index_of[node] = int(found.group(1))
                members.setdefault(index_of[node], []).append(node)
                break
    # A tensor the layer makes from constants alone (Falcon's ``torch.tensor([-2])``) is
    # lifted to the top of the graph with no module stack: it is the layer's, made once
    # per layer as the whole export makes it, when only that layer reads it.
    order = {node: p for p, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if (node.op == "call_function" and not node.all_input_nodes and node.users
                and not node.meta.get("nn_module_stack")):
            readers = {index_of.get(user, -1) for user in node.users}
            if len(readers) == 1 and -1 not in readers:
                members[readers.pop()].append(node)
    return {i: sorted(nodes, key=order.__getitem__) for i, nodes in members.items()}


def _same_layers(members: dict[int, list[torch.fx.Node]], path: str, depth: int,
                 period: int) -> bool:
    """Whether each of the last ``period`` of the ``depth`` exported layers is one graph
    with the layer a period before it: the same ops in the same order, each argument the
    same value, the same node outside the layers, the same position in the layer, the
    same parameter of the layer's own, or a value of an earlier layer (the layer before,
    as a copy reads the copy before it, or layer 0, which every later layer may read as
    one fixed value: the recorded runs tell the two apart). Layer 0 reads from before
    the layers what the layer a period later reads from earlier layers (the embedding,
    where that one reads the layer before's output): those values stand for an earlier
    layer's there."""
    def reads(index: int) -> set[torch.fx.Node]:
        return {a for node in members[index] for a in node.all_input_nodes}

    def shape(index: int) -> list[tuple[Any, ...]]:
        here = {node: p for p, node in enumerate(members[index])}
        before = {node for earlier in range(index) for node in members[earlier]}
        if index == 0:
            before = reads(0) - reads(period)
        prefix = f"{path}.{index}."

        def kind(node: torch.fx.Node) -> Any:
            if node in here:
                return ("here", here[node])
            if node.op == "get_attr" and str(node.target).startswith(prefix):
                return ("own", str(node.target)[len(prefix):])
            if node in before:
                return ("before",)
            return node

        return [(n.op, n.target, torch.fx.map_arg(n.args, kind), torch.fx.map_arg(n.kwargs, kind))
                for n in members[index]]

    return all(shape(index - period) == shape(index) for index in range(depth - period, depth))


def _own_attrs(gm: torch.fx.GraphModule, path: str, index: int) -> dict[torch.fx.Node, str]:
    """The layer's parameter and buffer reads: node -> name inside the layer."""
    prefix = f"{path}.{index}."
    return {n: str(n.target)[len(prefix):] for n in gm.graph.nodes
            if n.op == "get_attr" and str(n.target).startswith(prefix)}


def _add_attrs(
    gm: torch.fx.GraphModule, model: torch.nn.Module, prefix: str,
    attrs: dict[torch.fx.Node, str], after: dict[bool, torch.fx.Node | None],
    params: set[str],
) -> dict[torch.fx.Node, torch.fx.Node]:
    """The model's tensors under ``prefix`` for each of ``attrs`` bound on ``gm`` under
    their own names, as a stage binds them, and read by new ``get_attr`` nodes, each after
    ``after[whether it is a parameter (its name in params)]``, which then is that node:
    template node -> its copy."""
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node, name in attrs.items():
        target = f"{prefix}{name}"
        bind(gm, model, target)
        kind = target in params
        place = after[kind]
        assert place is not None
        with gm.graph.inserting_after(place):
            after[kind] = copies[node] = gm.graph.get_attr(target)
        copies[node].meta = dict(node.meta)
    return copies


def _copy(
    gm: torch.fx.GraphModule, template: list[torch.fx.Node], after: torch.fx.Node,
    source: Callable[[torch.fx.Node, list[torch.fx.Node]], torch.fx.Node],
    lifted: set[torch.fx.Node], after_lifted: torch.fx.Node | None,
) -> list[torch.fx.Node]:
    """``template``'s nodes again, each argument node taken from ``source(node, the copies
    made so far)``: the ``lifted`` ones after ``after_lifted``, the rest after ``after``."""
    made: list[torch.fx.Node] = []
    for node in template:
        at_top = node in lifted
        with gm.graph.inserting_after(after_lifted if at_top else after):
            copy = gm.graph.create_node(
                node.op, node.target,
                torch.fx.map_arg(node.args, lambda a: source(a, made)),
                torch.fx.map_arg(node.kwargs, lambda a: source(a, made)),
                type_expr=node.type)
        if at_top:
            after_lifted = copy
        else:
            after = copy
        made.append(copy)
    return made


def _moved_meta(node_meta: dict[str, Any], path: str, template: int, index: int
                ) -> dict[str, Any]:
    """A copy's ``node.meta``: the template's (layer ``template``), its module stack naming
    layer ``index``."""
    moved = dict(node_meta)
    stack = node_meta.get("nn_module_stack")
    if stack:
        pattern = re.compile(re.escape(f"{path}.{template}") + r"(?=\.|$)")
        renamed = f"{path}.{index}"
        moved["nn_module_stack"] = {
            pattern.sub(renamed, key): (pattern.sub(renamed, module_path), kind)
            for key, (module_path, kind) in stack.items()
        }
    return moved
