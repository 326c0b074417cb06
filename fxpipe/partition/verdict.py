"""What a partition proved of the split it found: the solver's report (``SolverReport``).

``partition`` (``solve.py``) finds the split; this words its status and bound from what
the exact CP-SAT solve and the block bound proved (``exact_report``), or from the
replicated search's solve (``replicated_report``).
"""

from __future__ import annotations

import time

from fxpipe.partition.bound import trivial_bound
from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.evaluate import Evaluation
from fxpipe.partition.ilp import IlpResult
from fxpipe.partition.problem import Problem
from fxpipe.plan import SolverReport

__all__ = ["PROVED", "exact_report", "replicated_report"]

# A bound this close below a split proves it optimal. CP-SAT's own OPTIMAL is exact for
# its scaled rows only, which sit 0.01-0.15 % off the real costs on the HF shapes.
PROVED = 1e-4


def exact_report(problem: Problem, exact: Coarsening, evaluation: Evaluation,
                 result: IlpResult, phases: list[IlpResult], *, start: float,
                 lower: float | None) -> SolverReport:
    """What the exact solve ``result`` and the block bound ``lower`` (``bound.py``) proved
    about the best split found (``evaluation``)."""
    objective = evaluation.bottleneck_s
    lower = 0.0 if lower is None else lower
    if lower >= objective * (1 - PROVED):
        status, bound = "OPTIMAL", min(objective, lower)
    elif result.status == "OPTIMAL":
        status, bound = "OPTIMAL", min(objective, result.bound)
    elif result.status == "INFEASIBLE":
        # Nothing with T <= the warm start's value in the scaled model: the warm start is
        # optimal up to the rounding margin (see ilp.py).
        status, bound = "OPTIMAL", objective * (1 - 1e-9)
    else:
        status, bound = "FEASIBLE", min(result.bound, objective)
    bound = min(objective, max(bound, trivial_bound(problem), lower))
    return SolverReport(
        method="cp-sat",
        status=status,
        objective=objective,
        bound=bound,
        wall_s=time.perf_counter() - start,
        solved_nodes=exact.num_coarse,
        graph_nodes=len(problem.nodes),
        wall_clock_stopped=any(phase.wall_clock_stopped for phase in phases),
    )


def replicated_report(result: IlpResult, evaluation: Evaluation, *, graph_nodes: int
                      ) -> SolverReport:
    """A replicated search's solve ``result`` as the report of its split
    (``evaluation``): CP-SAT's own status and bound."""
    return SolverReport(method="cp-sat", status=result.status,
                        objective=evaluation.bottleneck_s,
                        bound=min(result.bound, evaluation.bottleneck_s), wall_s=result.wall_s,
                        solved_nodes=result.num_nodes, graph_nodes=graph_nodes)
