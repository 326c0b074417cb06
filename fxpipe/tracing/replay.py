"""Tracing a list of alike layers once: ``symbolic_trace`` records one layer's nodes and
replays them for each later layer alike, instead of running its forward again.

``symbolic_trace`` runs every layer's Python (some 75 us an op; 3 of the 30 CPU seconds
that GPipe's 1,663-layer Transformer-L takes to plan). Under it a layer's forward sees
proxies, not values, so what it records is fixed by what its Python can read: its class,
its attributes, the globals its methods name, and how it is called. ``LayerReplay`` keys
each layer of an ``nn.ModuleList`` or ``nn.Sequential`` by these as it is called
(``_state``: every attribute of every module in it, its parameters' and buffers' shapes,
dtypes and devices, the values of the globals its classes' methods name; no hooks,
nothing shared with another layer) and replays a recorded layer's nodes for a later
layer with the same key and a call of the same form (``_Call``: the same constants,
proxies in the same places). Each copy reads the new layer's modules and parameters and
the new call's inputs, and is the node the tracer would have made, name and
``nn_module_stack`` included.

A recording is replayed only once a second layer with its key has traced to the same
nodes (``_same``: torchvision's ViT layers do not, each writing its input's name into an
assert's message), and the last layer of each list is always traced and compared: where
it differs, state no key holds changed between layers, and the caller traces again
without replaying (``ReplayMismatch``). What neither sees is the assumption: a helper
elsewhere that reads state the model changes between layers, alike at the second and
the last. A recording that reads anything but its own modules and inputs (a constant
the tracer stores on the model, a value of the layer before) is never replayed, nor one
whose forward changes its own layer.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

__all__ = ["MIN_LAYERS", "LayerReplay", "ReplayMismatch"]

MIN_LAYERS = 6  # shorter lists are traced whole: two traced, one checked, little saved

_HOOKS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks",
)
# kept by nn.Module for its own bookkeeping, not read by forward
_BOOKKEEPING = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks", "_is_full_backward_hook")
_MOST, _DEEPEST = 1024, 8  # the containers a key holds by value, each attribute or global
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, type(Ellipsis))


class ReplayMismatch(Exception):
    """The last layer of a list, traced, is not what replaying its recording made."""


class _Unkeyable(Exception):
    """A value a layer's key cannot hold (a tensor that is no parameter or buffer)."""


@dataclass
class _Call:
    """How a layer was called: the structure of its arguments, their constants, and which
    proxies stand where (by first place, so that the same proxy twice stays the same)."""

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]
    proxies: list[torch.fx.Proxy]

    @staticmethod
    def of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call | None:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        form: list[Any] = []
        proxies: list[torch.fx.Proxy] = []
        for leaf in leaves:
            if isinstance(leaf, torch.fx.Proxy):
                if isinstance(leaf, torch.fx.proxy.Attribute):
                    return None  # its node is made only where forward uses it
                place = next((i for i, p in enumerate(proxies) if p is leaf), len(proxies))
                if place == len(proxies):
                    proxies.append(leaf)
                form.append(("proxy", place))
                continue
            try:
                form.append(("value", _value(leaf)))
            except _Unkeyable:
                return None
        return _Call(spec, tuple(form), proxies)

    @property
    def form(self) -> tuple[Any, ...]:
        """What a replay must match: all but the proxies themselves."""
        return (self.spec, self.leaves)


@dataclass
class _Recording:
    """One layer's trace: its nodes, what they read from its call and what it returned."""

    prefix: str  # the layer's qualified name and a dot
    call: _Call
    nodes: list[torch.fx.Node]
    called: list[str]  # the modules it called, in order, below the layer's own name
    out: tuple[pytree.TreeSpec, list[Any]]  # proxy leaves as their nodes


class LayerReplay:
    """What a ``torch.fx.Tracer`` needs to replay alike layers (see the module docstring):
    the tracer calls ``call`` from its ``call_module``."""

    def __init__(self, root: torch.nn.Module, enabled: bool = True) -> None:
        self._places: dict[int, bool] = {}  # id(layer): whether it ends its list
        # by the layer's state (``_state``) and its call's form
        self._recorded: dict[tuple[Any, ...], _Recording] = {}
        self._checked: set[tuple[Any, ...]] = set()  # those a second layer traced to
        self._called: list[str] | None = None
        # the tracer's proxies of parameters and buffers by name (``Tracer.getattr``'s
        # cache), which a replayed layer's attributes join, as traced ones do
        self.cache: dict[str, torch.fx.Proxy] | None = None
        if enabled and not _global_hooks():
            self._find(root)
        self.replayed = 0

    def _find(self, root: torch.nn.Module) -> None:
        seen: dict[int, int] = {}
        for _, m in root.named_modules(remove_duplicate=False):
            seen[id(m)] = seen.get(id(m), 0) + 1
        for _, p in root.named_parameters(remove_duplicate=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
        for module in root.modules():
            if not isinstance(module, torch.nn.ModuleList | torch.nn.Sequential):
                continue
            if len(module) < MIN_LAYERS:
                continue
            for i, layer in enumerate(module):
                if all(seen[id(x)] == 1 for x in [*layer.modules(), *layer.parameters()]):
                    self._places[id(layer)] = i == len(module) - 1

    def _fresh(self, tracer: torch.fx.Tracer, recording: _Recording, prefix: str) -> bool:
        """Whether nothing the recording calls or reads under ``prefix`` was traced yet
        (tracing would then name a second call otherwise, or reuse the attribute's node)."""
        if any(tracer.num_calls.get(prefix + c, 0) for c in recording.called):
            return False
        return not self.cache or not any(
            _target(n, recording.prefix, prefix) in self.cache
            for n in recording.nodes if n.op == "get_attr")

    def call(self, tracer: torch.fx.Tracer, m: torch.nn.Module, name: str,
             args: tuple[Any, ...], kwargs: dict[str, Any],
             trace: Callable[[], Any]) -> Any:
        """``m`` called as ``name`` with ``args``, ``kwargs``: its recording replayed where
        one fits, else ``trace()`` recorded."""
        if self._called is not None:  # the modules the layer being recorded calls
            self._called.append(name)
        last = self._places.get(id(m))
        call = _Call.of(args, kwargs) if last is not None else None
        state = _key(m) if call is not None else None
        if state is None or call is None or tracer.num_calls.get(name, 0):
            return trace()
        key = (state, call.form)
        known = self._recorded.get(key)
        prefix = f"{name}."
        if known is not None and key in self._checked and not last \
                and self._fresh(tracer, known, prefix):
            self.replayed += 1
            if self._called is not None:
                self._called.extend(prefix + c for c in known.called)
            return _replay(tracer, known, prefix, call, self.cache)
        outer, self._called = self._called, []
        before = _last(tracer.graph)
        try:
            out = trace()
        finally:
            called, self._called = self._called, outer
        if outer is not None:
            outer.extend(called)
        recording = _recorded(tracer, before, prefix, call, called, out)
        if recording is not None and _key(m) != state:
            recording = None  # forward changed the layer: a replay would not
        if known is None:
            if recording is not None:
                self._recorded[key] = recording
        elif recording is not None and _same(known, recording):
            self._recorded[key] = recording
            self._checked.add(key)
        elif key in self._checked:
            raise ReplayMismatch(f"{name} does not trace as {known.prefix[:-1]} did")
        else:
            del self._recorded[key]
        return out


def _global_hooks() -> bool:
    from torch.nn.modules import module as hooks

    return any((hooks._global_forward_hooks, hooks._global_forward_pre_hooks,
                hooks._global_backward_hooks, hooks._global_backward_pre_hooks))


def _key(layer: torch.nn.Module) -> tuple[Any, ...] | None:
    """``_state``, or None where it cannot be had."""
    try:
        key = _state(layer)
        hash(key)
    except (_Unkeyable, TypeError):
        return None
    return key


def _state(layer: torch.nn.Module) -> tuple[Any, ...]:
    """Everything a layer's trace can depend on but its inputs, comparable across layers
    (taken as it is called: the model may set a layer's attributes before calling it)."""
    modules = []
    for name, module in layer.named_modules(remove_duplicate=False):
        items: list[Any] = []
        for attr, value in vars(module).items():
            if attr in _HOOKS:
                if value:
                    raise _Unkeyable(attr)
            elif attr in ("_parameters", "_buffers"):
                items.append((attr, tuple((n, _tensor(t)) for n, t in value.items())))
            elif attr == "_modules":
                items.append((attr, tuple((n, type(s)) for n, s in value.items())))
            elif attr == "_non_persistent_buffers_set":
                items.append((attr, tuple(sorted(value))))
            elif attr not in _BOOKKEEPING:
                items.append((attr, _value(value)))
        read = tuple((g, _value(space[g])) for space, names in _globals_read(type(module))
                     for g in names if g in space)
        modules.append((name, type(module), tuple(items), read))
    return tuple(modules)


def _globals_read(cls: type) -> tuple[tuple[dict[str, Any], tuple[str, ...]], ...]:
    """The module globals each method or property of ``cls`` (below ``nn.Module``) may
    read, with the namespace it reads them in: a layer that branches on a global the
    model sets before each call traces as the global is then. Found once a class."""
    known = _READ.get(cls)
    if known is not None:
        return known
    found = []
    for klass in cls.__mro__:
        if klass in (torch.nn.Module, object):
            break
        for value in vars(klass).values():
            function: Any = value.fget if isinstance(value, property) else getattr(
                value, "__func__", value)
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                found.append((function.__globals__, tuple(sorted(_names(code)))))
    _READ[cls] = tuple(found)
    return _READ[cls]


_READ: dict[type, tuple[tuple[dict[str, Any], tuple[str, ...]], ...]] = {}


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _tensor(t: torch.Tensor | None) -> Any:
    if t is None:
        return None
    return (type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _value(value: Any, budget: list[int] | None = None, depth: int = 0) -> Any:
    """``value`` as a key: plain values by value, containers by their items, tensors not
    at all (``_Unkeyable``, as containers of more than ``_MOST`` items in all or
    ``_DEEPEST`` levels, or that hold themselves), anything else by identity (shared
    configs, functions, modules)."""
    if isinstance(value, _PLAIN):
        if isinstance(value, float) and math.isnan(value):
            return ("nan",)
        return (type(value), value)
    if isinstance(value, torch.Tensor | torch.fx.Proxy):
        raise _Unkeyable(type(value).__name__)
    if isinstance(value, slice | tuple | list | dict | set | frozenset):
        kind = type(value)
        if isinstance(value, slice):
            value = (value.start, value.stop, value.step)
        budget = [_MOST] if budget is None else budget
        budget[0] -= len(value)
        if budget[0] < 0 or depth == _DEEPEST:
            raise _Unkeyable(kind.__name__)
        if isinstance(value, dict):
            return (kind, tuple((_value(k, budget, depth + 1), _value(v, budget, depth + 1))
                                for k, v in value.items()))
        items = tuple(_value(v, budget, depth + 1) for v in value)
        return (kind, tuple(sorted(items, key=repr)) if isinstance(value, set | frozenset)
                else items)
    return ("is", id(value))


def _last(graph: torch.fx.Graph) -> torch.fx.Node | None:
    return next(iter(reversed(graph.nodes)), None)


def _since(graph: torch.fx.Graph, before: torch.fx.Node | None) -> list[torch.fx.Node]:
    node = next(iter(graph.nodes), None) if before is None else before.next
    nodes = []
    while node is not None and node.op != "root":
        nodes.append(node)
        node = node.next
    return nodes


def _recorded(tracer: torch.fx.Tracer, before: torch.fx.Node | None, prefix: str,
              call: _Call, called: list[str], out: Any) -> _Recording | None:
    """The recording of a layer just traced, or None where replaying it could differ from
    tracing: a node reads something but the layer's own nodes and inputs, or names a
    module or attribute outside the layer, or the layer returns what is no plain value
    or proxy of its own."""
    nodes = _since(tracer.graph, before)
    inside = set(nodes) | {p.node for p in call.proxies}
    for node in nodes:
        if node.op in ("call_module", "get_attr") and not str(node.target).startswith(prefix):
            return None
        if node.op not in ("call_function", "call_method", "call_module", "get_attr"):
            return None
        if any(arg not in inside for arg in node.all_input_nodes):
            return None
    leaves, spec = pytree.tree_flatten(out)
    kept: list[Any] = []
    for leaf in leaves:
        if type(leaf) is torch.fx.Proxy and leaf.node in inside:
            kept.append(leaf.node)
            continue
        if isinstance(leaf, torch.fx.Proxy | torch.Tensor):
            return None
        try:
            _value(leaf)
        except _Unkeyable:
            return None
        kept.append(("value", leaf))
    own = [c[len(prefix):] for c in called if c.startswith(prefix)]
    return _Recording(prefix, call, nodes, own, (spec, kept))


def _renamed(name: str, old: str, new: str) -> str:
    """``name``, the layer at prefix ``old`` or a module, attribute or call key inside it,
    as the layer at prefix ``new``'s; any other name as it is."""
    if name == old[:-1]:
        return new[:-1]
    return new + name[len(old):] if name.startswith(old) else name


def _target(node: torch.fx.Node, old: str, new: str) -> Any:
    """``node``'s target in the layer at prefix ``new``, the node being the layer at
    ``old``'s (its modules and attributes renamed)."""
    if node.op in ("call_module", "get_attr"):
        return _renamed(str(node.target), old, new)
    return node.target


def _inputs(recorded: _Call, now: _Call) -> dict[torch.fx.Node, torch.fx.Node]:
    """The nodes a recorded call read, each to the node another call of its form reads."""
    return {p.node: q.node for p, q in zip(recorded.proxies, now.proxies, strict=True)}


def _stack(tracer: torch.fx.Tracer, recording: _Recording, node: torch.fx.Node,
           prefix: str) -> dict[str, tuple[str, Any]]:
    """``node``'s ``nn_module_stack`` under the layer at ``prefix``: the tracer's stack now,
    then the recorded entries from the layer's own on, renamed."""
    stack = dict(tracer.module_stack)
    own = recording.prefix[:-1]
    inside = False
    for key, (path, kind) in node.meta.get("nn_module_stack", {}).items():
        inside = inside or path == own
        if inside:
            stack[_renamed(key, recording.prefix, prefix)] = (
                _renamed(path, recording.prefix, prefix), kind)
    return stack


def _replay(tracer: torch.fx.Tracer, recording: _Recording, prefix: str, call: _Call,
            cache: dict[str, torch.fx.Proxy] | None) -> Any:
    """The recorded layer's nodes made again for the layer at ``prefix`` called as
    ``call``, as tracing it would have made them; what it returns."""
    env = _inputs(recording.call, call)
    proxies = {p.node: q for p, q in zip(recording.call.proxies, call.proxies, strict=True)}
    for name in [prefix[:-1], *(prefix + c for c in recording.called)]:
        tracer.num_calls[name] = tracer.num_calls.get(name, 0) + 1
    for node in recording.nodes:
        target = _target(node, recording.prefix, prefix)
        copy = tracer.graph.create_node(
            node.op, target, torch.fx.map_arg(node.args, env.__getitem__),
            torch.fx.map_arg(node.kwargs, env.__getitem__), type_expr=node.type)
        copy.meta = {**node.meta, "nn_module_stack": _stack(tracer, recording, node, prefix)}
        scope = tracer.node_name_to_scope.get(node.name)
        if scope is not None:
            tracer.node_name_to_scope[copy.name] = (
                _renamed(scope[0], recording.prefix, prefix), scope[1])
        env[node] = copy
        if node.op == "get_attr" and cache is not None:
            cache[str(target)] = proxies[node] = tracer.proxy(copy)
    spec, leaves = recording.out

    def out(leaf: Any) -> Any:
        if isinstance(leaf, torch.fx.Node):
            if leaf not in proxies:
                proxies[leaf] = tracer.proxy(env[leaf])
            return proxies[leaf]
        return leaf[1]

    return pytree.tree_unflatten([out(leaf) for leaf in leaves], spec)


def _same(first: _Recording, second: _Recording) -> bool:
    """Whether ``second`` is ``first`` replayed under its name and inputs, node for node."""
    if len(first.nodes) != len(second.nodes) or first.called != second.called:
        return False
    env = _inputs(first.call, second.call)
    for a, b in zip(first.nodes, second.nodes, strict=True):
        target = _target(a, first.prefix, second.prefix)
        mapped = (torch.fx.map_arg(a.args, env.__getitem__),
                  torch.fx.map_arg(a.kwargs, env.__getitem__))
        if (a.op, target, mapped) != (b.op, b.target, (b.args, b.kwargs)) or a.type != b.type:
            return False
        env[a] = b
    spec_a, leaves_a = first.out
    spec_b, leaves_b = second.out
    return spec_a == spec_b and [
        env.get(x, x) if isinstance(x, torch.fx.Node) else x for x in leaves_a] == leaves_b
