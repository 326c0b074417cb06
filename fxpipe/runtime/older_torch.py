"""What older releases of torch.distributed.pipelining need to run the stages.

Each shim works around one thing torch 2.11 does; a current torch (2.13) does neither.
"""

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["skip_warmup_sends_to_self", "step"]

_NO_GRADIENT = "only Tensors of floating point dtype can require gradients"


def skip_warmup_sends_to_self(stages: list[Any]) -> list[Any]:
    """torch 2.11 warms a rank's stages up with a send to and a receive from each stage's
    neighbours, whichever rank holds them. Where two adjacent stages share a rank (both
    stages of an interleaved plan on one rank, the turn of a V) that is a send to itself,
    which gloo refuses ("Pair is not connected"); the schedule hands such values over in
    the process, so those sends are left out of the warm-up. Returns ``stages``."""
    if len(stages) > 1:
        me = dist.get_rank()
        for stage in stages:
            warmup = stage._get_init_p2p_neighbors_ops
            stage._get_init_p2p_neighbors_ops = functools.partial(_to_others, warmup, me)
    return stages


def _to_others(warmup: Any, me: int) -> list[Any]:
    return [op for op in warmup() if op.peer != me]


def step(schedule: Any, stages: Sequence[Any], *feed: Any, **kwargs: Any) -> None:
    """``schedule.step``, without merging the last stage's outputs where torch can leave
    them (no caller reads them, and torch concatenates them along dim 0, which a 0-dim
    output, a model's own loss, does not have). torch 2.11's stage asks every tensor it
    receives for a gradient, which a tensor of integers or booleans (a mask, positions)
    cannot have: that error becomes one line naming what is received."""
    if "return_outputs" in inspect.signature(schedule.step).parameters:
        kwargs["return_outputs"] = False
    try:
        schedule.step(*feed, **kwargs)
    except RuntimeError as error:
        if _NO_GRADIENT not in str(error):
            raise
        received = []
        for stage in (s for s in stages if not s.is_first):
            names = [f"{name!r} ({x.dtype})"
                     for name, x in zip(stage.submod.receives, stage.inputs_meta, strict=True)
                     if not (x.is_floating_point() or x.is_complex())]
            if names:
                received.append(f"stage {stage.stage_index} receives {', '.join(names)}")
        raise RuntimeError(
            f"{'; '.join(received) or 'a stage receives integers or booleans'}, and torch "
            f"{torch.__version__} asks every received tensor for a gradient: run the stages "
            "under torch 2.13 or later, or in one process with the runner") from None
