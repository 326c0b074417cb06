"""Measuring under torchrun: each rank times its own stages, rank 0's card holds all.

    schedule = build_schedule(stages, loss_fn)
    with measure_ranks(schedule, stages, num_stages, warmup=1) as card:  # collective
        for batch, target in data:
            train_step(schedule, stages, *batch, target=target)
    if rank == 0:
        card.save("fxpipe-out/measured.json")

The same ``measured.json`` as ``PipelineRunner.measure`` writes (measure.py), naming the
same plan, read by ``fxpipe report``. Every rank runs its stages under torch's schedule,
so the spans are taken where torch calls into a stage: ``forward_one_chunk`` is a forward,
``backward_one_chunk`` and ``backward_weight_one_chunk`` (a zero-bubble schedule's B and
W) a backward, and the schedule's wait for its batched sends and receives is
communication (a wait on a rank with several stages is shared evenly between them). The
step is ``schedule.step``, the loss included; the gradient reductions after it are not.
A stage replicated on several ranks reports the median of its replicas; the step time
is the slowest rank's. Leaving the ``with`` block gathers every rank's figures (all
ranks must leave it together); the card is then the same on every rank.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules

from .measure import SPANS, Measurement, Recorder
from .measured_file import package_plan

__all__ = ["measure_ranks"]

_CHUNKS = {"forward_one_chunk": "forward", "backward_one_chunk": "backward",
           "backward_weight_one_chunk": "backward"}


@contextlib.contextmanager
def measure_ranks(schedule: Any, stages: Sequence[Any], num_stages: int, *,
                  warmup: int = 1) -> Iterator[Measurement]:
    """Time every ``schedule.step`` run inside, after the first ``warmup``, on this rank's
    ``stages`` (torch ``PipelineStage`` objects of a ``num_stages``-stage pipeline); on
    leaving, gather all ranks' figures into the yielded card (a collective call)."""
    if not hasattr(torch_schedules, "_wait_batch_p2p"):
        raise ValueError(f"this torch ({torch.__version__}) runs its pipeline schedules "
                         f"without the communication hook fxpipe times; measure in one "
                         f"process with PipelineRunner.measure")
    if not all(hasattr(stage, method) for stage in stages for method in _CHUNKS):
        raise ValueError("a plan with unevenly replicated stages runs fxpipe's own schedule "
                         "table under torchrun, which is not measured; measure it in one "
                         "process with PipelineRunner.measure")
    own = [int(stage.stage_index) for stage in stages]
    device = stages[0].device
    microbatches = int(stages[0].submod.microbatches)  # set by build_schedule
    recorder = Recorder(num_stages, microbatches, warmup, [device] * num_stages,
                        lambda k: torch.cuda.current_stream(device)
                        if device.type == "cuda" else None)
    card = Measurement(num_stages, microbatches, warmup=warmup, device=recorder.card.device,
                      clock=recorder.card.clock)
    card.serial = True  # a rank's stages run one after another, on its current stream
    card.plan = package_plan()  # the plan.json of the package torchrun runs
    with contextlib.ExitStack() as patches:
        for stage in stages:
            for method, kind in _CHUNKS.items():
                _patch(patches, stage, method, _timing(recorder, int(stage.stage_index), kind))
        _patch(patches, schedule, "step", _timing(recorder, None, "step"))
        _patch(patches, torch_schedules, "_wait_batch_p2p", _timing(recorder, own[0], "comm"))
        yield card
    _gather(card, recorder.card, own)


def _patch(stack: contextlib.ExitStack, owner: Any, name: str,
           wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``owner.name`` wrapped by ``wrap`` until ``stack`` closes."""
    original = getattr(owner, name)
    had_own = name in vars(owner)
    setattr(owner, name, wrap(original))
    stack.callback(setattr if had_own else delattr, owner, name,
                   *((original,) if had_own else ()))


def _timing(recorder: Recorder, k: int | None,
            kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if k is None:
                span = recorder.step()
            elif kind == "comm":
                span = recorder.span(k, kind)
            else:
                span = recorder.compute(k, kind)
            with span:
                return call(*args, **kwargs)

        return timed

    return wrap


def _gather(card: Measurement, mine: Measurement, own: list[int]) -> None:
    """Fill ``card`` with every rank's own stages from ``mine`` (collective)."""
    comm_share = 1.0 / len(own)  # the rank's waits, recorded on its first stage
    steps = [{k: {kind: step[own[0]]["comm"] * comm_share if kind == "comm" else step[k][kind]
                  for kind in SPANS} for k in own} for step in mine.totals]
    local = {"steps": steps, "step_s": mine.step_times, "seen": mine.seen,
             "peak": {k: mine.peak_memory[k] for k in own},
             # with the rank: another process's cuda:0 or cpu is not this one's to share
             "devices": {k: f"{mine.stage_devices[k]} on rank {dist.get_rank()}" for k in own}}
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, local)
    card.seen = max(rank["seen"] for rank in ranks)
    held = {k: [rank for rank in ranks if k in rank["peak"]] for k in range(card.num_stages)}
    assert all(held.values()), "a stage no rank runs"
    for i in range(min(len(rank["step_s"]) for rank in ranks)):
        totals = [{kind: statistics.median(rank["steps"][i][k][kind] for rank in held[k])
                   for kind in SPANS} for k in range(card.num_stages)]
        card.add_step(totals, max(rank["step_s"][i] for rank in ranks))
    for k, holders in held.items():
        peaks = [rank["peak"][k] for rank in holders if rank["peak"][k] is not None]
        card.peak_memory[k] = max(peaks) if peaks else None
        card.stage_devices[k] = holders[0]["devices"][k]
