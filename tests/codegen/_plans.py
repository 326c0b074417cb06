"""Hand-written plans: a traced graph cut into K contiguous chunks of its op order."""

from __future__ import annotations

import torch.fx

from fxpipe.plan import DynamicDim, Estimate, Plan, SolverReport, StagePlan, StageRecompute

# K: number of stages, M: number of micro-batches.


def contiguous_plan(
    graph: torch.fx.Graph,
    num_stages: int,
    *,
    schedule: str = "gpipe",
    microbatches: int = 2,
    recompute: tuple[bool | str, ...] | None = None,
    model: str = "",
    replicas: tuple[int, ...] | None = None,
    virtual_stages: int = 1,
    shared_inputs: tuple[str, ...] = (),
    dynamic_dims: tuple[DynamicDim, ...] = (),
    starts: tuple[int, ...] | None = None,
) -> Plan:
    """Cut the graph's ops (graph order is topological) into K chunks of near-equal
    size; a get_attr node goes with its first user. Always a valid monotone plan.
    Stage k recomputes as ``recompute[k]`` says (a mode, or a bool: full or none) and runs
    on ``replicas[k]`` GPUs (default 1), or, with ``virtual_stages`` v > 1,
    v stages share a GPU as the schedule places them. ``shared_inputs`` (the graph inputs
    handed whole to every micro-batch) and ``dynamic_dims`` as the compiler records them.
    ``starts``: instead of equal chunks, stage k begins at op ``starts[k]`` (starts[0] = 0)."""
    ops = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    assert len(ops) >= num_stages, (len(ops), num_stages)
    stage_of: dict[str, int] = {}
    assert starts is None or (len(starts) == num_stages and starts[0] == 0), starts
    for i, node in enumerate(ops):
        stage_of[node.name] = (i * num_stages // len(ops) if starts is None
                               else sum(i >= start for start in starts) - 1)
    for node in graph.nodes:
        if node.op == "get_attr":
            users = [stage_of[u.name] for u in node.users if u.name in stage_of]
            stage_of[node.name] = min(users, default=0)
    order = [n.name for n in graph.nodes if n.name in stage_of]
    recompute = recompute or (False,) * num_stages
    replicas = replicas or (1,) * num_stages
    stages = tuple(
        StagePlan(
            index=k,
            nodes=tuple(name for name in order if stage_of[name] == k),
            recompute=_mode(recompute[k]),
            keeps=_keeps(recompute[k]),
            replicas=replicas[k],
        )
        for k in range(num_stages)
    )
    return Plan(
        num_stages=num_stages,
        schedule=schedule,
        microbatches=microbatches,
        stages=stages,
        solver=SolverReport("hand-written", "HEURISTIC", 0.0, 0.0, 0.0),
        estimate=Estimate(0.0, 0.0, 0.0, 0, True),
        model=model,
        virtual_stages=virtual_stages,
        shared_inputs=shared_inputs,
        dynamic_dims=dynamic_dims,
    )


def _mode(recompute: bool | str) -> StageRecompute:
    """A stage's recompute mode: a mode's name (``"selective:W:N"``: selective), or a bool
    (full or none)."""
    if isinstance(recompute, str):
        return StageRecompute(recompute.split(":")[0])
    return StageRecompute.FULL if recompute else StageRecompute.NONE


def _keeps(recompute: bool | str) -> tuple[int, int] | None:
    """The keep rule of ``"selective:W:N"``: (W, N); None for any other mode."""
    if not isinstance(recompute, str) or ":" not in recompute:
        return None
    _, work, width = recompute.split(":")
    return int(work), int(width)
