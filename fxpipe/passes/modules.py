"""The module each node came from, by qualified name (call_module target or nn_module_stack)."""

from __future__ import annotations

import torch
import torch.fx

from fxpipe import meta

__all__ = ["annotate_modules"]


def annotate_modules(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Fill ``meta.MODULE`` on every node.

    ``call_module`` nodes name their module directly. Other nodes carry the tracer's
    ``nn_module_stack`` (symbolic_trace and torch.export both record it): the innermost
    entry is the module, the entries are its enclosing modules. ``get_attr`` nodes belong
    to the module that owns the attribute.
    """
    for node in gm.graph.nodes:
        meta.MODULE.set(node, _module_of(gm, node))
    return gm


def _module_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> meta.ModuleInfo:
    if node.op == "call_module":
        path = str(node.target)
        return meta.ModuleInfo(path, type(gm.get_submodule(path)).__name__, _prefixes(path))
    if node.op == "get_attr":
        owner = str(node.target).rpartition(".")[0]
        return meta.ModuleInfo(owner, _type_name(gm, owner), _prefixes(owner))
    stack = node.meta.get("nn_module_stack") or {}
    entries = [(str(path), kind) for path, kind in stack.values()]
    if not entries:
        return meta.ModuleInfo("", type(gm).__name__)
    path, kind = entries[-1]
    name = kind.__name__ if isinstance(kind, type) else str(kind).rpartition(".")[2]
    return meta.ModuleInfo(path, name, tuple(p for p, _ in entries if p))


def _prefixes(path: str) -> tuple[str, ...]:
    """ "a.b.c" -> ("a", "a.b", "a.b.c")."""
    parts = path.split(".") if path else []
    return tuple(".".join(parts[: i + 1]) for i in range(len(parts)))


def _type_name(gm: torch.fx.GraphModule, path: str) -> str:
    try:
        return type(gm.get_submodule(path)).__name__
    except AttributeError:
        return ""
