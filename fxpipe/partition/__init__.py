"""Choosing stage cuts: the problem as plain data, the CP-SAT program, the baselines.

No torch here: ``fxpipe.lower`` turns an annotated FX graph into a ``Problem``;
``partition`` answers with a stage per node, the proof status, and the baselines'
figures, all scored by the one cost model in ``evaluate``.
"""

from fxpipe.partition.baselines import BASELINES, baselines, interval_dp
from fxpipe.partition.coarsen import Coarsening, coarsen, exact_groups
from fxpipe.partition.cost import StageCost, StageSums, choose_recompute, stage_cost
from fxpipe.partition.errors import (
    InfeasibleMemoryError,
    NoSolutionError,
    PipedreamTieError,
    ProblemTooLargeError,
    TooManyStagesError,
)
from fxpipe.partition.evaluate import Evaluation, evaluate, violations
from fxpipe.partition.ilp import IlpResult, StageModel
from fxpipe.partition.keep import shortest_step
from fxpipe.partition.nothing_fits import dp_fits, fewest_gpus
from fxpipe.partition.problem import (
    Comm,
    Edge,
    Node,
    Problem,
    Recompute,
    TiedGroup,
    TiedPolicy,
)
from fxpipe.partition.solve import MAX_NODES, Partition, check_size, partition

__all__ = [
    "BASELINES",
    "MAX_NODES",
    "Coarsening",
    "Comm",
    "Edge",
    "Evaluation",
    "IlpResult",
    "InfeasibleMemoryError",
    "NoSolutionError",
    "Node",
    "Partition",
    "PipedreamTieError",
    "Problem",
    "ProblemTooLargeError",
    "Recompute",
    "StageCost",
    "StageModel",
    "StageSums",
    "TiedGroup",
    "TiedPolicy",
    "TooManyStagesError",
    "baselines",
    "check_size",
    "choose_recompute",
    "coarsen",
    "dp_fits",
    "evaluate",
    "exact_groups",
    "fewest_gpus",
    "interval_dp",
    "partition",
    "shortest_step",
    "stage_cost",
    "violations",
]
