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
from fxpipe.partition.cost import StageCost
from fxpipe.partition.evaluate import Evaluation
from fxpipe.partition.problem import Problem
from fxpipe.plan import DynamicDim, Estimate, Plan, SolverReport, StagePlan, StageRecompute

__all__ = ["build_plan", "stage_of_nodes"]


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
                keeps=_keeps(problem, cost),
                skips=problem.unkept if cost.recompute is StageRecompute.SELECTIVE else (),
            )
        )

    tied = {}
    for group in problem.tied:
        used = {evaluation.stage_of[i] for i in group.nodes}
        tied[group.name] = "colocated" if len(used) == 1 else "replicated"
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
        baselines=dict(baselines),
        notes=tuple(notes),
        virtual_stages=problem.virtual_stages,
        dynamic_dims=tuple(dynamic_dims),
        shared_inputs=tuple(shared_inputs),
    )


def _keeps(problem: Problem, cost: StageCost) -> tuple[int, int] | None:
    """A selective stage's keep rule, where it keeps less than all (``StagePlan.keeps``)."""
    if cost.recompute is not StageRecompute.SELECTIVE:
        return None
    rule = problem.keep_levels[cost.keep_level]
    return None if rule == (0, 0) else rule
