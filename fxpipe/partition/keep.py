"""The split a plan keeps: the search's, or a baseline's whose step is shorter.

``partition`` minimises the slowest stage, which decides the step where micro-batches
are many. The step itself (``Estimate.iteration_s``) is (M - 1) x the slowest stage plus
every stage once, which few micro-batches weigh: a baseline's cuts that send less can
make a shorter one (the GPT onto 2 at M = 1: uniform-layers' step 0.693 ms, the least
bottleneck's 0.703 ms). Such a split is kept where it fits, named as the report's method,
with the status and gap of its bottleneck.
"""

from __future__ import annotations

from dataclasses import replace

from fxpipe.partition.evaluate import evaluate, violations
from fxpipe.partition.solve import Partition
from fxpipe.partition.verdict import PROVED

__all__ = ["shortest_step"]


def shortest_step(found: Partition) -> Partition:
    """``found``, or the same problem split by the baseline that fits with the shortest
    step where that is shorter than ``found``'s (the module docstring)."""
    problem, report, step = found.problem, found.report, found.evaluation.estimate.iteration_s
    if problem.replicates:
        return found
    shorter = [(estimate.iteration_s, name) for name, estimate in found.baselines.items()
               if estimate.fits and estimate.iteration_s < step * (1 - 1e-9)
               and not violations(problem, found.baseline_splits[name])]
    if not shorter:
        return found
    name = min(shorter)[1]
    kept = evaluate(problem, found.baseline_splits[name])
    proved = report.status == "OPTIMAL" and kept.bottleneck_s <= report.objective * (1 + PROVED)
    return replace(found, stage_of=tuple(found.baseline_splits[name]), evaluation=kept,
                   report=replace(report, method=name, status="OPTIMAL" if proved else "FEASIBLE",
                                  objective=kept.bottleneck_s,
                                  bound=min(report.bound, kept.bottleneck_s)))
