"""Which torch.distributed.pipelining class runs each schedule kind under torchrun, and
where that class puts the stages: the one map the torchrun pipeline reads, and the
compiler's schedule kinds (fxpipe/schedules/kinds.py) with it.

# K: stage modules, N: ranks of one pipeline.

    placement   stage j runs on rank
    line        j                     one stage per rank (K = N)
    loop        j % N                 interleaved: K / N stages per rank
    v           min(j, K - 1 - j)     two stages per rank in a V (K = 2N)
"""

from dataclasses import dataclass
from typing import Any

__all__ = ["TORCH_SCHEDULES", "TorchSchedule", "placed", "schedule_class", "torch_schedule"]


@dataclass(frozen=True)
class TorchSchedule:
    """One kind under torchrun: torch's class (by name: importing this module does not
    import torch's pipelining), where it puts the stages, and whether it splits each
    backward into an input gradient (I) and a weight gradient (W)."""

    class_name: str
    placement: str  # "line", "loop" or "v" (see the module docstring)
    splits_backward: bool = False


# schedule kind (plan.json's "schedule") -> how torch runs it; PipeDream's weight stashing
# has no torch class (the single-process runner only)
TORCH_SCHEDULES = {
    "gpipe": TorchSchedule("ScheduleGPipe", "line"),
    "1f1b": TorchSchedule("Schedule1F1B", "line"),
    "interleaved": TorchSchedule("ScheduleInterleaved1F1B", "loop"),
    "zb1p": TorchSchedule("ScheduleInterleavedZeroBubble", "line", splits_backward=True),
    "zbv": TorchSchedule("ScheduleZBVZeroBubble", "v", splits_backward=True),
    "dualpipev": TorchSchedule("ScheduleDualPipeV", "v", splits_backward=True),
}


def torch_schedule(kind: str) -> TorchSchedule:
    """How torch runs ``kind``; a kind it has no class for is one line with the choices."""
    try:
        return TORCH_SCHEDULES[kind]
    except KeyError:
        raise ValueError(f"no torch.distributed.pipelining class runs schedule {kind!r}; "
                         f"under torchrun use one of {sorted(TORCH_SCHEDULES)}") from None


def placed(kind: str, num_stages: int, num_ranks: int) -> tuple[int, ...] | None:
    """The rank of each of ``num_stages`` stages on ``num_ranks`` ranks as torch's class
    for ``kind`` places them; None where it cannot run that many stages on that many."""
    k, n, placement = num_stages, num_ranks, torch_schedule(kind).placement
    if placement == "line":
        return tuple(range(k)) if k == n else None
    if placement == "loop":
        return tuple(j % n for j in range(k)) if k > n and k % n == 0 else None
    return tuple(min(j, k - 1 - j) for j in range(k)) if k == 2 * n else None


def schedule_class(kind: str) -> Any:
    """torch's class for ``kind`` (imports torch.distributed.pipelining: seconds)."""
    from torch.distributed import pipelining

    return getattr(pipelining, torch_schedule(kind).class_name)
