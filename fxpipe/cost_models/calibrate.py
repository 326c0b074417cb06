"""Rescale a cost model's node times by what a training step measured.

A plan predicts each stage's forward and backward seconds; a measurement
(``measured.json``, written by the runtime) measures them. The ratio measured /
predicted of stage k, for forward and for backward, becomes the factor of every op the
measured plan put on stage k. A stage that recomputes runs its forward again inside its
backward: that part is forward work and takes the forward's factor, and the backward's
is fitted from the rest, so the measured plan's stages are predicted again as measured.
The host time torch's SAC adds to a selective stage takes the forward's factor too
(``meta.TimeInfo.host_scale``). The factors are of the plan's times, which ran every op
at ``efficiency`` of the cost model's speed: the costs' own take factor / efficiency.
Ops are named as in ``plan.json``'s ``stages[].nodes``, so
an op keeps its factor wherever the new plan puts it; an op the measured plan did not
have takes the median factor, but a model with fewer than half its ops in the measured
plan is refused: its factors would be mostly that guess. Memory: where every stage had
a device of its own, the ratio of measured to predicted peak, over what varies with the
split (everything but parameters, gradients, optimizer state and stashed weights),
scales each op's saved activations likewise. Communication is bytes over link
bandwidth and is not rescaled, tensor parallelism's collectives inside a stage's forward
and backward included (``StageFigures.collective_s``): the compute takes the rest.

Calibration rewrites ``meta.TIME`` (and ``meta.BYTES``) before ``lower``: the solver
sees calibrated costs and nothing else changes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch.fx

from fxpipe import meta
from fxpipe.passes.base import OP_NODES

__all__ = ["Calibration", "StageFactors", "StageFigures", "apply", "fit"]


@dataclass(frozen=True)
class StageFigures:
    """One stage of the measured plan: its op names and a figure pair per cost."""

    nodes: tuple[str, ...]
    forward_s: float
    backward_s: float
    # bytes that vary with the split: predicted total minus parameter state; None
    # where the measurement has no memory of this stage alone
    memory: float | None = None
    # predicted: the part of backward_s that runs the forward again (recompute), and the
    # seconds of forward_s and backward_s that are tensor parallelism's collectives
    recompute_s: float = 0.0
    collective_s: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class StageFactors:
    """measured / predicted of one stage (1.0 where nothing was predicted)."""

    forward: float
    backward: float
    memory: float | None = None  # None: memory not calibrated


@dataclass(frozen=True)
class Calibration:
    stages: tuple[StageFactors, ...]  # per stage of the measured plan
    stage_of: dict[str, int]  # op name -> its stage in the measured plan
    median: StageFactors  # for ops the measured plan did not have
    efficiency: float = 1.0  # the share of the cost model's speed the measured plan assumed

    def factors(self, name: str) -> StageFactors:
        k = self.stage_of.get(name)
        return self.median if k is None else self.stages[k]


def fit(predicted: Sequence[StageFigures], measured: Sequence[StageFigures], *,
        efficiency: float = 1.0) -> Calibration:
    """Per-stage factors: ``measured[k]`` / ``predicted[k]`` (same stages, same order), the
    backward's of what is not the forward run again (``_backward``)."""
    assert len(predicted) == len(measured), (len(predicted), len(measured))
    # load_measured refuses a measured time that is not a finite number above 0
    assert all(math.isfinite(t) and t > 0 for m in measured for t in (m.forward_s, m.backward_s))

    def ratio(m: float | None, p: float | None) -> float | None:
        if m is None or p is None or p <= 0 or m <= 0:
            return None
        return m / p

    stages = []
    for p, m in zip(predicted, measured, strict=True):
        collective = p.collective_s[0]
        forward = (ratio(m.forward_s - collective, p.forward_s - collective)
                   or ratio(m.forward_s, p.forward_s) or 1.0)
        stages.append(StageFactors(
            forward=forward,
            backward=_backward(p, m, forward) or ratio(m.backward_s, p.backward_s) or 1.0,
            memory=ratio(m.memory, p.memory),
        ))
    memories = [s.memory for s in stages if s.memory is not None]
    median = StageFactors(
        forward=statistics.median(s.forward for s in stages),
        backward=statistics.median(s.backward for s in stages),
        memory=statistics.median(memories) if memories else None,
    )
    stage_of = {name: k for k, p in enumerate(predicted) for name in p.nodes}
    return Calibration(stages=tuple(stages), stage_of=stage_of, median=median,
                       efficiency=efficiency)


def _backward(predicted: StageFigures, measured: StageFigures, forward: float) -> float | None:
    """The backward's factor: what was measured beyond its collectives and its forward
    run again (that at the forward's factor, its collectives aside) over what was
    predicted beyond them. None where that is all of it, or the measurement leaves
    nothing beyond it (then the whole backward's ratio stands)."""
    forward_collectives, collectives = predicted.collective_s
    again = predicted.recompute_s
    again_computed = again - (forward_collectives if again > 0 else 0.0)
    if again <= 0 and collectives <= 0:
        return None  # the whole backward's ratio is this one
    rest = predicted.backward_s - collectives - again_computed
    beyond = measured.backward_s - collectives - forward * again_computed
    return beyond / rest if rest > 0 and beyond > 0 else None


def apply(gm: torch.fx.GraphModule, calibration: Calibration) -> int:
    """Rescale every op's time (and saved bytes, where memory was calibrated); returns
    how many ops the measured plan did not name (they took the median factor). A
    ValueError, and nothing rescaled, where fewer than half the ops are the measured
    plan's: a measurement of another model."""
    ops = [node for node in gm.graph.nodes if node.op in OP_NODES]
    unknown = [node.name for node in ops if node.name not in calibration.stage_of]
    if 2 * len(unknown) > len(ops):
        known = len(ops) - len(unknown)
        raise ValueError(
            f"only {known} of this model's {len(ops)} ops are in the plan that was measured "
            f"(this model has {_some(unknown)}, that plan {_some(list(calibration.stage_of))}"
            f"): the measurement is of another model; pass the model that plan was made "
            f"from, or measure this model's own plan"
        )
    speed = calibration.efficiency
    for node in ops:
        f = calibration.factors(node.name)
        time = meta.TIME.get(node)
        meta.TIME.set(node, replace(
            time,
            forward_s=time.forward_s * f.forward / speed,
            backward_s=time.backward_s * f.backward / speed,
            backward_weight_s=time.backward_weight_s * f.backward / speed,
            host_scale=time.host_scale * f.forward,
            source=f"{time.source}+calibrated",
        ))
        if f.memory is not None and meta.BYTES.has(node):
            info = meta.BYTES.get(node)
            meta.BYTES.set(node, replace(info, saved_bytes=round(info.saved_bytes * f.memory)))
    return len(unknown)


def _some(names: list[str]) -> str:
    """The first few of ``names``, for a message."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
