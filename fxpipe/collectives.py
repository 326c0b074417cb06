"""The time of a collective, as plain math (no torch): one formula, read by the cost
models (``cost_models/comm.py``: a tied parameter's gradient sum), the solver
(``partition/problem.py``: a replicated stage's gradients) and the layout search
(``partition/layout.py``: each stage's gradient sync over the data-parallel pipelines).

Legend: r: ranks in the ring, bw: link bandwidth (bytes / s, one direction), lat:
per-message latency (s).
"""

from __future__ import annotations

__all__ = ["ring_allreduce_s"]


def ring_allreduce_s(nbytes: float, ranks: int, bandwidth: float, latency_s: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``ranks`` ranks: a reduce-scatter
    then an all-gather, 2(r - 1) steps, each moving nbytes / r per rank:
    2(r - 1)/r * nbytes / bw + 2(r - 1) * lat (FSDP's reduce-scatter and all-gather of the
    same bytes move as much). One rank costs nothing; whether an empty one runs at all is
    the caller's to say."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps / ranks * nbytes / bandwidth + steps * latency_s
