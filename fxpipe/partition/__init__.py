"""Choosing stage cuts: the problem as plain data, the CP-SAT program, the baselines.

No torch here: ``fxpipe.lower`` turns an annotated FX graph into a ``Problem``;
``partition`` answers with a stage per node, the proof status, and the baselines'
figures, all scored by the one cost model in ``evaluate``.
"""

from fxpipe.partition.baselines import BASELINES, baselines, interval_dp
from fxpipe.partition.coarsen import Coarsening, coarsen, exact_groups
from fxpipe.partition.evaluate import Evaluation, StageCost, evaluate, violations
from fxpipe.partition.ilp import IlpResult, StageModel
from fxpipe.partition.plan import Estimate, Plan, SolverReport, StageMemory, StagePlan
from fxpipe.partition.problem import (
    Comm,
    Edge,
    Node,
    Problem,
    Schedule,
    TiedGroup,
    TiedPolicy,
    in_flight,
)
from fxpipe.partition.solve import (
    InfeasibleMemoryError,
    NoSolutionError,
    Partition,
    TooManyStagesError,
    partition,
)
from fxpipe.partition.units import format_bytes, parse_bytes

__all__ = [
    "BASELINES",
    "Coarsening",
    "Comm",
    "Edge",
    "Estimate",
    "Evaluation",
    "IlpResult",
    "InfeasibleMemoryError",
    "NoSolutionError",
    "Node",
    "Partition",
    "Plan",
    "Problem",
    "Schedule",
    "SolverReport",
    "StageCost",
    "StageMemory",
    "StageModel",
    "StagePlan",
    "TiedGroup",
    "TiedPolicy",
    "TooManyStagesError",
    "baselines",
    "coarsen",
    "evaluate",
    "exact_groups",
    "format_bytes",
    "in_flight",
    "interval_dp",
    "parse_bytes",
    "partition",
    "violations",
]
