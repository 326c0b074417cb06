"""Which values share storage: views, in-place writes, and the graph inputs written.

The one home of aliasing in an FX graph. ``lower`` keeps every in-place op where the graph
has it relative to the other readers of what it writes; codegen copies the graph inputs a
stage writes (``written_inputs``). "A view" here is an op whose result may share storage
with its first argument (``is_view``): aten ops say so in their schema, methods and
functions are named in ``VIEW_NAMES``. (The roofline's free ops, ``cost_models/analytic.py``,
are another set on purpose: ops priced at no bytes moved, among them metadata reads such
as ``size``, and not ``contiguous``, which copies when it does not share.)
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch.fx

__all__ = ["VIEW_NAMES", "aliases", "is_view", "mutated_input", "written_inputs"]

_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul,
})


# Methods and functions whose result may share storage with their first argument.
VIEW_NAMES = frozenset({
    "view", "view_as", "reshape", "reshape_as", "unsqueeze", "squeeze", "transpose",
    "swapaxes", "permute", "t", "expand", "expand_as", "narrow", "select", "unflatten",
    "flatten", "chunk", "split", "tensor_split", "unbind", "diagonal", "as_strided", "unfold",
    "movedim", "moveaxis", "contiguous", "getitem", "real", "imag", "view_as_real",
    "detach", "alias", "swapdims",
})


def written_inputs(gm: torch.fx.GraphModule, ops: Iterable[torch.fx.Node]) -> tuple[str, ...]:
    """The graph inputs (placeholder names, in graph order) that ``ops`` (nodes of ``gm``)
    write in place, directly, through a view or through another in-place result
    (``x.mul_(2).add_(1)``). The stage that runs them changes its caller's tensor."""
    written: set[str] = set()
    for node in ops:
        base = mutated_input(gm, node)
        while base is not None and base.op != "placeholder":
            first = base.args[0] if base.args else None
            shares = isinstance(first, torch.fx.Node) and (
                is_view(base) or mutated_input(gm, base) is first)
            base = first if shares else None  # type: ignore[assignment]
        if base is not None:
            written.add(base.name)
    return tuple(n.name for n in gm.graph.find_nodes(op="placeholder") if n.name in written)


def aliases(gm: torch.fx.GraphModule, base: torch.fx.Node) -> list[torch.fx.Node]:
    """``base`` and the nodes whose value shares its storage: views of it and the results
    of in-place ops on it, transitively."""
    found = [base]
    seen = {base}
    for node in found:
        for user in node.users:
            shares = user.args and user.args[0] is node and (
                is_view(user) or mutated_input(gm, user) is node)
            if shares and user not in seen:
                seen.add(user)
                found.append(user)
    return found


def is_view(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target) in VIEW_NAMES
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:  # an aten op: its first result aliases an input
        alias = schema.returns[0].alias_info if schema.returns else None
        return alias is not None and not alias.is_write
    return getattr(node.target, "__name__", "") in VIEW_NAMES


def mutated_input(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose value ``node`` writes in place (``x.relu_()``, ``x += y``,
    ``aten.add_``, ``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)``), if any."""
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node):
        return None
    target = node.target
    if node.op == "call_method":
        name = str(target)
        writes = name.endswith("_") and not name.startswith("_")
    elif node.op == "call_module":
        writes = getattr(gm.get_submodule(str(target)), "inplace", False) is True
    else:
        schema = getattr(target, "_schema", None)
        alias = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
        name = getattr(target, "__name__", "")
        writes = (
            target in _INPLACE_OPERATORS
            or (alias is not None and alias.is_write)
            or (name.endswith("_") and not name.startswith("_"))
            or node.kwargs.get("inplace") is True
        )
    return first if writes else None
