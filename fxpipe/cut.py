"""The stage cut: what each stage of a plan runs, receives and sends, computed once.

torch.fx's ``split_module`` style: each part's inputs and outputs are computed at the
boundary, here, and everything downstream reads them. ``fxpipe.planning`` records
them in the plan (``StagePlan.inputs`` / ``outputs``, plan.json); codegen cuts the
traced graph with the same function, so a hand-written plan needs only its nodes.

    nodes    the ops the stage runs: its own, plus every get_attr it reads
    inputs   values it receives: graph inputs or earlier stages' outputs
    outputs  values it makes that a later stage reads or the model returns

get_attr nodes (parameters, buffers) are never communicated: every stage that reads
one binds it, so they are neither inputs nor outputs. All three lists are node names
in graph order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch.fx

__all__ = ["StageIO", "cut_stages"]


@dataclass(frozen=True)
class StageIO:
    """The values one stage exchanges with the others, by node name, in graph order."""

    index: int
    nodes: tuple[str, ...]  # the ops it runs (get_attr nodes it reads included)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def cut_stages(
    graph: torch.fx.Graph, stage_of: Mapping[str, int], num_stages: int
) -> list[StageIO]:
    """Every stage's ``StageIO``. ``stage_of`` maps every op (neither placeholder nor
    output) to its stage, stage indices never decreasing along an edge; a get_attr
    node's own stage only matters when nothing reads it."""
    output = graph.output_node()
    # one pass over the graph, each node to the stages it belongs to, in graph order
    runs: list[list[torch.fx.Node]] = [[] for _ in range(num_stages)]
    inputs: list[list[torch.fx.Node]] = [[] for _ in range(num_stages)]
    outputs: list[list[torch.fx.Node]] = [[] for _ in range(num_stages)]
    for n in graph.nodes:
        if n.op == "output":
            continue
        readers = {stage_of[u.name] for u in n.users if u.op != "output"}
        if n.op == "get_attr":  # a get_attr node belongs to every stage that reads it
            for k in sorted(readers) if n.users else [stage_of[n.name]]:
                runs[k].append(n)
            continue
        own = stage_of[n.name] if n.op != "placeholder" else None
        if own is not None:
            runs[own].append(n)
            if any(u is output or (u.op != "output" and stage_of[u.name] > own)
                   for u in n.users):
                outputs[own].append(n)
        for k in sorted(readers - {own}):  # a get_attr node reads nothing
            inputs[k].append(n)
    return [
        StageIO(k, tuple(n.name for n in runs[k]), tuple(n.name for n in inputs[k]),
                tuple(n.name for n in outputs[k]))
        for k in range(num_stages)
    ]
