"""Turn a stage assignment of the lowered problem into a ``Plan`` over the fine graph.

Applies the solver's answer to the graph: which fine nodes each stage runs, the
values it receives and sends (the cut, ``fxpipe.cut``), the parameters it holds and
the costs the shared evaluation predicts. The solver never sees the graph; codegen
never sees the solver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.fx

from fxpipe import meta
from fxpipe.cut import cut_stages
from fxpipe.lower import Lowered
from fxpipe.partition.baselines import BASELINES
from fxpipe.partition.cost import StageCost
from fxpipe.partition.evaluate import Evaluation
from fxpipe.partition.problem import Problem
from fxpipe.partition.solve import GAP
from fxpipe.plan import DynamicDim, Estimate, Layout, Plan, SolverReport, StagePlan, StageRecompute
from fxpipe.units import format_indices, format_ms

__all__ = ["build_plan", "stage_of_nodes", "state_keys"]


def stage_of_nodes(lowered: Lowered, stage_of: Sequence[int]) -> dict[torch.fx.Node, int]:
    """Stage of every non-placeholder, non-output node (get_attr: its first reader's stage)."""
    stages = {node: stage_of[i] for i, node in enumerate(lowered.ops)}
    graph = lowered.ops[0].graph if lowered.ops else None
    for node in graph.nodes if graph is not None else ():
        if node.op == "get_attr":
            readers = [stages[u] for u in node.users if u in stages]
            stages[node] = min(readers, default=0)
    return stages


def build_plan(
    lowered: Lowered,
    problem: Problem,
    evaluation: Evaluation,
    report: SolverReport,
    *,
    baselines: Mapping[str, Estimate],
    model: str,
    tracer: str,
    device: str,
    optimizer: str,
    precision: str = "32-true",
    notes: Sequence[str] = (),
    dynamic_dims: Sequence[DynamicDim] = (),
    shared_inputs: Sequence[str] = (),
    layout: Layout | None = None,
) -> Plan:
    """``problem``: the one solved (``lowered.problem``, or it with the stage count a
    replicated split chose)."""
    stages = stage_of_nodes(lowered, evaluation.stage_of)
    graph_nodes = list(lowered.ops[0].graph.nodes) if lowered.ops else []
    by_stage: list[list[torch.fx.Node]] = [[] for _ in range(problem.num_stages)]
    for node in graph_nodes:
        if node in stages:
            by_stage[stages[node]].append(node)
    cut = (
        cut_stages(lowered.ops[0].graph, {n.name: k for n, k in stages.items()},
                   problem.num_stages)
        if lowered.ops else []
    )

    stage_plans = []
    for k, members in enumerate(by_stage):
        params = sorted(
            {name for n in members if n.op != "get_attr" for name in lowered.params.get(n.name, ())}
        )
        flops = [meta.FLOPS.get(n) for n in members]
        cost = evaluation.stages[k]
        stage_plans.append(
            StagePlan(
                index=k,
                nodes=tuple(n.name for n in members),
                inputs=cut[k].inputs if cut else (),
                outputs=cut[k].outputs if cut else (),
                parameters=tuple(params),
                flops_forward=sum(f.forward for f in flops),
                flops_backward=sum(f.backward for f in flops),
                forward_s=cost.forward_s,
                backward_s=cost.backward_s,
                comm_s=cost.comm_s,
                memory=cost.memory,
                recompute=cost.recompute,
                replicas=cost.replicas,
                backward_weight_s=cost.backward_weight_s,
                recompute_s=cost.recompute_s,
                collective_s=cost.collective_s,
                keeps=_keeps(problem, cost),
                skips=problem.unkept if cost.recompute is StageRecompute.SELECTIVE else (),
            )
        )

    tied = {}
    for group in problem.tied:
        used = {evaluation.stage_of[i] for i in group.nodes}
        tied[group.name] = "colocated" if len(used) == 1 else "copied"
    return Plan(
        num_stages=problem.num_stages,
        schedule=problem.schedule.value,
        microbatches=problem.microbatches,
        stages=tuple(stage_plans),
        solver=report,
        estimate=evaluation.estimate,
        model=model,
        tracer=tracer,
        device=device,
        memory_limit=problem.memory_limit,
        optimizer=optimizer,
        precision=precision,
        tied=tied,
        state_keys=state_keys(graph_nodes[0].graph.owning_module) if graph_nodes else (),
        baselines=dict(baselines),
        notes=(*notes, *step_notes(report, problem.microbatches),
               *idle_notes(stage_plans, report, problem.schedule.value)),
        virtual_stages=problem.virtual_stages,
        dynamic_dims=tuple(dynamic_dims),
        shared_inputs=tuple(shared_inputs),
        layout=layout,
    )


def state_keys(gm: torch.fx.GraphModule | None) -> tuple[tuple[str, ...], ...]:
    """``Plan.state_keys``: the keys of ``gm``'s ``state_dict()`` under a module or tensor
    a node reads (a stage binds what its nodes read, under the same names), grouped by
    tensor, so that a parameter tied under several names is one group. A non-persistent
    buffer the graph reads by name is listed too: tracing copies it as a persistent one."""
    assert gm is not None, "a traced graph belongs to its GraphModule"
    read = {str(n.target) for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
    groups: dict[int, list[str]] = {}
    for key, value in gm.state_dict(keep_vars=True).items():
        parts = key.split(".")
        if any(".".join(parts[:i]) in read for i in range(1, len(parts) + 1)):
            groups.setdefault(id(value), []).append(key)
    return tuple(sorted(tuple(sorted(names)) for names in groups.values()))


def step_notes(report: SolverReport, microbatches: int) -> list[str]:
    """Where the plan keeps a baseline's cuts for their shorter step
    (``partition.keep.shortest_step``), why: the search minimises the slowest stage."""
    if report.method not in BASELINES:
        return []
    m = microbatches
    runs = ("runs each stage once" if m == 1 else
            f"runs each stage once and the slowest {m - 1} times more")
    return [f"the cuts are the {report.method} baseline's: a step of {m} micro-batch"
            f"{'es' * (m > 1)} {runs}, so the split with the least slowest stage (the search "
            f"proved none under {format_ms(report.bound)}) is not the shortest step; these "
            f"cuts' is shorter."]


def idle_notes(stages: Sequence[StagePlan], report: SolverReport, schedule: str) -> list[str]:
    """What the report says of stages that hold no parameters or compute nothing: a GPU
    that only passes values on is rarely what a user wants, and where the search was not
    proved optimal it may be one move from a better split."""
    idle = [s.index for s in stages if s.flops_forward == 0]
    bare = [s.index for s in stages if not s.parameters and s.flops_forward > 0]
    if not idle and not bare:
        return []
    parts = []
    if idle:
        parts.append(f"{_stages(idle)} {'computes' if len(idle) == 1 else 'compute'} nothing "
                     "(no FLOPs)")
    if bare:
        parts.append(f"{_stages(bare)} {'holds' if len(bare) == 1 else 'hold'} no parameters")
    if report.status == "OPTIMAL":
        why = "the solver proved no other split better under the cost model"
    elif report.gap <= GAP:  # within what the solver lets stand: a longer search is no fix
        why = (f"the search stopped {report.status} within {report.gap:.2%} of its bound, "
               "so no split is faster by more than that")
    else:
        why = (f"the search stopped {report.status} with a gap of {report.gap:.2%}, so a "
               "better split may exist: raise --work-limit or --time-limit, or use fewer --gpus")
    shares = (" (under a V each GPU runs two stages: such a stage's GPU works on its "
              "other one)" if schedule in ("zbv", "dualpipev") else "")
    return [f"{'; '.join(parts)}{shares}: {why}."]


def _stages(indices: Sequence[int]) -> str:
    return f"stage{'s' * (len(indices) > 1)} {format_indices(indices)}"


def _keeps(problem: Problem, cost: StageCost) -> tuple[int, int] | None:
    """A selective stage's keep rule, where it keeps less than all (``StagePlan.keeps``)."""
    if cost.recompute is not StageRecompute.SELECTIVE:
        return None
    rule = problem.keep_levels[cost.keep_level]
    return None if rule == (0, 0) else rule
