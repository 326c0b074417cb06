"""One stage's ops as a graph of their own, ready to print: its inputs as placeholders,
its outputs as the output, the graph's own node names, no private keyword arguments that
hold their default, and device constants replaced by the device of a tensor the stage
holds (so a stage placed on a GPU creates its tensors there)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fxpipe.cut import StageIO

__all__ = ["follow_stage_device", "sub_graph"]


def sub_graph(graph: torch.fx.Graph, io: StageIO,
              by_name: Mapping[str, torch.fx.Node] | None = None) -> torch.fx.Graph:
    """The stage's ops as a graph of their own: INPUTS in, OUTPUTS out, names kept.
    ``by_name``: ``graph``'s nodes by name (made here when not given; a caller cutting
    many stages makes it once)."""
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    by_name = by_name if by_name is not None else {n.name: n for n in graph.nodes}
    for name in io.inputs:
        env[by_name[name]] = sub.placeholder(name)
    for name in io.nodes:  # in graph order
        node = by_name[name]
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[by_name[name]] for name in io.outputs))
    for node in sub.nodes:
        node.type = None  # no annotations: they would need the types importable
        node.kwargs = _public_kwargs(node)
        if node.op not in ("output",):
            assert node.name in by_name, f"fx renamed a value: {node.name}"
    follow_stage_device(sub, by_name)
    return sub


def _public_kwargs(node: torch.fx.Node) -> dict[str, torch.fx.node.Argument]:
    """The node's keyword arguments without torch's private ones (``_stacklevel``) that
    hold their default: a call a person writes, with the same meaning."""
    private = [key for key in node.kwargs if key.startswith("_")]
    if node.op != "call_function" or not private:
        return dict(node.kwargs)
    try:
        parameters = inspect.signature(node.target).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return dict(node.kwargs)
    kept = dict(node.kwargs)
    for key in private:
        default = parameters[key].default if key in parameters else inspect.Parameter.empty
        if default is not inspect.Parameter.empty and kept[key] == default:
            del kept[key]
    return kept


def follow_stage_device(sub: torch.fx.Graph, by_name: Mapping[str, torch.fx.Node]) -> None:
    """Replace device constants with the device of a tensor the stage holds.

    torch.export writes the tracing device into ops (``arange(..., device=cpu)``,
    ``to(x, device=cpu)``); a stage placed on a GPU must create its tensors there.
    """
    users = [n for n in sub.nodes if _holds_device((n.args, n.kwargs))]
    anchor = next(
        (n for n in sub.nodes if n.op in ("placeholder", "get_attr")
         and isinstance(by_name[n.name].meta.get("val"), torch.Tensor)),
        None,
    )
    if not users or anchor is None:
        return  # nothing to follow, or no tensor to follow (the literal stays)
    placeholders = [n for n in sub.nodes if n.op == "placeholder"]
    if anchor.op == "get_attr" and placeholders:
        placeholders[-1].append(anchor)  # an attribute read has no inputs: move it up front
    elif anchor.op == "get_attr":
        next(iter(sub.nodes)).prepend(anchor)
    with sub.inserting_after(anchor):
        device = sub.create_node("call_function", getattr, (anchor, "device"),
                                 name="stage_device")

    def follow(value: object) -> object:
        return device if isinstance(value, torch.device) else value

    for node in users:
        node.args, node.kwargs = pytree.tree_map(follow, (node.args, node.kwargs))


def _holds_device(value: object) -> bool:
    return any(isinstance(leaf, torch.device) for leaf in pytree.tree_leaves(value))
