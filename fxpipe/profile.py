"""Per-module and per-op cost summaries of an annotated graph (``fxpipe profile``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch.fx

from fxpipe import meta
from fxpipe.passes.base import OP_NODES

__all__ = ["ProfileRow", "auto_depth", "summarize"]

@dataclass(frozen=True)
class ProfileRow:
    name: str
    nodes: int
    flops_forward: int
    flops_backward: int
    param_bytes: int
    activation_bytes: int  # saved for backward, one micro-batch
    output_bytes: int
    forward_s: float
    backward_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _group_key(node: torch.fx.Node, by: str, depth: int) -> str:
    if by == "op":
        if node.op == "call_module":
            return meta.MODULE.get(node).type_name
        if node.op == "get_attr":
            return "parameters"
        target: Any = node.target
        return str(target) if isinstance(target, str) else getattr(target, "__name__", str(target))
    path = meta.MODULE.get(node).path
    parts = path.split(".") if path else []
    return ".".join(parts[:depth]) or "(root)"


def auto_depth(gm: torch.fx.GraphModule) -> int:
    """Down to the first level of repeated blocks ("blocks.0", "transformer.h.3"), else 1."""
    depths = []
    for node in _counted(gm.graph.nodes):
        parts = meta.MODULE.get(node).path.split(".")
        depths += [i + 1 for i, part in enumerate(parts) if part.isdigit()][:1]
    return min(depths, default=1)


def _counted(nodes: Iterable[torch.fx.Node]) -> list[torch.fx.Node]:
    return [n for n in nodes if n.op in OP_NODES or n.op == "get_attr"]


def summarize(
    gm: torch.fx.GraphModule, *, by: str = "module", depth: int | None = None
) -> tuple[list[ProfileRow], ProfileRow]:
    """Rows grouped by module (at ``depth`` levels) or by op, in graph order, and the total."""
    if by not in ("module", "op"):
        raise ValueError(f"cannot group by {by!r}; use 'module' or 'op'")
    level = depth if depth is not None else auto_depth(gm)
    groups: dict[str, list[torch.fx.Node]] = {}
    for node in _counted(gm.graph.nodes):
        groups.setdefault(_group_key(node, by, level), []).append(node)
    rows = [_row(name, nodes) for name, nodes in groups.items()]
    if by == "op":
        rows.sort(key=lambda r: (-r.flops_forward, -r.forward_s, r.name))
    return rows, _row("total", _counted(gm.graph.nodes))


def _row(name: str, nodes: list[torch.fx.Node]) -> ProfileRow:
    flops = [meta.FLOPS.get(n) for n in nodes]
    memory = [meta.BYTES.get(n) for n in nodes]
    times = [meta.TIME.get(n) for n in nodes]
    params = {name: size for m in memory for name, size in m.params}  # tied: once
    return ProfileRow(
        name=name,
        nodes=sum(1 for n in nodes if n.op in OP_NODES),
        flops_forward=sum(f.forward for f in flops),
        flops_backward=sum(f.backward for f in flops),
        param_bytes=sum(params.values()),
        activation_bytes=sum(m.saved_bytes for m in memory),
        output_bytes=sum(m.output_bytes for m in memory),
        forward_s=sum(t.forward_s for t in times),
        backward_s=sum(t.backward_s for t in times),
    )
