"""Which of the model's own layers each stage holds, and where the cuts fall, by module.

The graph's nodes carry the module they came from (``meta.MODULE``). A stage's layers are
its nodes grouped by module path down to the block depth ("blocks.3", "model.layers.12";
``profile.auto_depth``), in the order the model runs them; a run of whole numbered
layers on one stage is one row ("blocks.2-5"), and a layer the cut goes through names
the parts of it each stage holds ("blocks.1: attn, mlp.fc"). A cut between stage j and
j + 1 is named by the modules of the last op of stage j and the first of stage j + 1, and
carries the values made on stages up to j that later stages read.

Plain records in graph and stage order, for report.html to draw (``html.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx

from fxpipe import meta
from fxpipe.plan import Plan

__all__ = ["Cut", "Layer", "cuts", "stage_layers"]

# torch.export's module stack for a node made outside every module (a symbolic size);
# such a node is the model's own op, like one with no stack at all
_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


@dataclass(frozen=True)
class Layer:
    """One row of a stage: a module at the block depth, or a run of numbered ones."""

    name: str  # "blocks.0", "blocks.2-5"; "" is the model's own ops, outside its layers
    type_name: str  # the module's class ("Block"), "" where no op names it
    parts: tuple[str, ...]  # where the layer is cut: the sub-modules this stage holds
    ops: int
    seconds: float  # forward + backward of one micro-batch
    count: int = 1  # numbered layers in the run


@dataclass(frozen=True)
class Cut:
    """The boundary between stage ``after_stage`` and the next."""

    after_stage: int
    last: str  # module path of the last op before the cut ("" the model's own)
    first: str  # module path of the first op after it
    # (node name, its module path, its bytes per micro-batch) of the values crossing it
    values: tuple[tuple[str, str, int], ...]

    @property
    def nbytes(self) -> int:
        """The bytes crossing it per micro-batch."""
        return sum(nbytes for _, _, nbytes in self.values)


def _path(node: torch.fx.Node) -> str:
    path = meta.MODULE.get(node).path
    return "" if path.split(".")[0] == _NO_MODULE else path


def _placed(gm: torch.fx.GraphModule, plan: Plan) -> list[tuple[torch.fx.Node, int]]:
    """(node, stage) of every node a stage holds, ops in graph order, then the get_attr
    nodes (torch.export puts every parameter first: the layers run in the ops' order)."""
    stage_of = plan.stage_of()
    held = [n for n in gm.graph.nodes if n.name in stage_of]
    ordered = [n for n in held if n.op != "get_attr"] + [n for n in held if n.op == "get_attr"]
    return [(n, stage_of[n.name]) for n in ordered]


def stage_layers(gm: torch.fx.GraphModule, plan: Plan, *, depth: int) -> list[list[Layer]]:
    """Each stage's layers, in the order the model runs them."""
    placed = _placed(gm, plan)
    # every module path prefix -> the stages holding a node under it, in first-seen
    # order, and how many nodes are under it
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for node, stage in placed:
        parts = _path(node).split(".") if _path(node) else []
        for prefix in ("", *(".".join(parts[: i + 1]) for i in range(len(parts)))):
            seen = holders.setdefault(prefix, [])
            if stage not in seen:
                seen.append(stage)
            sizes[prefix] = sizes.get(prefix, 0) + 1
    groups: dict[tuple[int, str], list[torch.fx.Node]] = {}
    types: dict[str, str] = {}  # a layer's class, from an op of its own (a residual add)
    for node, stage in placed:
        name = ".".join(_path(node).split(".")[:depth])
        groups.setdefault((stage, name), []).append(node)
        if name and _path(node) == name:
            types.setdefault(name, meta.MODULE.get(node).type_name)
    rows: list[list[Layer]] = [[] for _ in plan.stages]
    for (stage, name), nodes in groups.items():
        whole = name != "" and len(holders[name]) == 1
        rows[stage].append(Layer(
            name=name,
            type_name=types.get(name, ""),
            parts=() if whole or name == "" else _parts(name, nodes, stage, holders, sizes),
            ops=len(nodes),
            seconds=sum(meta.TIME.get(n).forward_s + meta.TIME.get(n).backward_s
                        for n in nodes if meta.TIME.has(n)),
        ))
    return [_runs(layers) for layers in rows]


def _parts(name: str, nodes: list[torch.fx.Node], stage: int,
           holders: dict[str, list[int]], sizes: dict[str, int]) -> tuple[str, ...]:
    """The parts of layer ``name`` that ``stage`` holds, relative to it, in the order they
    run: each sub-module it holds whole (``attn``); one it holds part of by the whole
    modules inside it that it holds (``mlp.fc``) or, where it holds ops of that module
    outside those, by their count (``self_attn (16 of 40 ops)``)."""
    children: dict[str, list[str]] = {}  # sub-module -> the stage's paths under it
    for node in nodes:
        path = _path(node)
        if path != name:  # not the layer's own ops (a residual add)
            relative = path[len(name) + 1:]
            children.setdefault(relative.split(".")[0], []).append(relative)
    found: list[str] = []
    for child, paths in children.items():
        wholes = [_whole(f"{name}.", path.split("."), stage, holders) for path in paths]
        if None in wholes:
            found.append(f"{child} ({len(paths)} of {sizes[f'{name}.{child}']} ops)")
        else:
            found += [w for w in dict.fromkeys(wholes) if w is not None]
    return tuple(found)


def _whole(prefix: str, parts: list[str], stage: int, holders: dict[str, list[int]]
           ) -> str | None:
    """The largest module on the path ``parts`` (under ``prefix``) that only ``stage``
    holds nodes of, relative to ``prefix``; None where none is."""
    return next((".".join(parts[: i + 1]) for i in range(len(parts))
                 if holders[prefix + ".".join(parts[: i + 1])] == [stage]), None)


def _runs(layers: list[Layer]) -> list[Layer]:
    """``layers`` with each run of whole numbered layers of one kind, one after another
    ("blocks.2", "blocks.3", "blocks.4"), as one row ("blocks.2-4")."""
    runs: list[list[Layer]] = []
    for layer in layers:
        if runs and _follows(runs[-1][-1], layer):
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return [run[0] if len(run) == 1 else _run(run) for run in runs]


def _run(run: list[Layer]) -> Layer:
    last = _NUMBERED.match(run[-1].name)
    assert last is not None, run  # _follows matched it
    return Layer(name=f"{run[0].name}-{last.group(2)}", type_name=run[0].type_name,
                 parts=(), ops=sum(x.ops for x in run), seconds=sum(x.seconds for x in run),
                 count=len(run))


def _follows(before: Layer, layer: Layer) -> bool:
    """Whether ``layer`` is the whole numbered layer right after the whole ``before``."""
    a, b = _NUMBERED.match(before.name), _NUMBERED.match(layer.name)
    return (a is not None and b is not None and not before.parts and not layer.parts
            and before.name != "" and a.group(1) == b.group(1)
            and before.type_name == layer.type_name and int(b.group(2)) == int(a.group(2)) + 1)


def cuts(gm: torch.fx.GraphModule, plan: Plan) -> list[Cut]:
    """The cut after each stage but the last, in stage order."""
    placed = _placed(gm, plan)
    stage_of = dict(placed)
    ops = [(node, stage) for node, stage in placed if node.op != "get_attr"]
    first: dict[int, torch.fx.Node] = {}
    last: dict[int, torch.fx.Node] = {}
    crossing: list[list[torch.fx.Node]] = [[] for _ in range(plan.num_stages - 1)]
    for node, stage in ops:
        first.setdefault(stage, node)
        last[stage] = node
        read_on = max((stage_of.get(user, -1) for user in node.users), default=-1)
        for j in range(stage, read_on):  # it crosses every cut between it and its reader
            crossing[j].append(node)
    return [Cut(
        after_stage=j,
        last=_path(last[j]) if j in last else "",
        first=_path(first[j + 1]) if j + 1 in first else "",
        values=tuple((node.name, _path(node),
                      meta.SHAPE.get(node).nbytes if meta.SHAPE.has(node) else 0)
                     for node in values),
    ) for j, values in enumerate(crossing)]
