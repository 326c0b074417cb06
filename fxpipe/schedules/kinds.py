"""The schedule kinds and how each behaves: ``ScheduleKind`` names them, ``KINDS`` says
how each builds its table, counts the micro-batches in flight, prices its bubble, and runs
under torchrun (a plan's own table: ``Plan.schedule_table``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from fxpipe.runtime.torch_schedules import TORCH_SCHEDULES
from fxpipe.schedules.flush import gpipe, interleaved_1f1b, one_f_one_b
from fxpipe.schedules.ticks import Table, peak_deferred, peak_in_flight
from fxpipe.schedules.zero_bubble import dualpipev, zb1p, zbv

__all__ = ["KINDS", "KindSpec", "ScheduleKind", "kind_of"]


class ScheduleKind(str, Enum):
    """A schedule by name; ``KINDS[kind]`` (or ``kind.spec``) says how it behaves."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    PIPEDREAM = "pipedream"
    ZB1P = "zb1p"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"

    @property
    def spec(self) -> KindSpec:
        return KINDS[self]


@dataclass(frozen=True)
class KindSpec:
    """How one schedule kind behaves. In the callables K counts stage modules (N * v
    of them on N GPUs when interleaved, see ``interleaved_devices``), v is the virtual
    stages per GPU (1 unless interleaved) and M the micro-batches."""

    # one line for report.md; {v}: stage modules per GPU, {n}: GPUs
    summary: str
    # (K, v, M) -> the clock-tick table over the K stage modules
    table: Callable[[int, int, int], Table]
    # (K, v, M) -> per stage module, the micro-batches whose activations it holds at its
    # peak: the solver's memory model multiplies saved activations by it
    flights: Callable[[int, int, int], tuple[int, ...]]
    # (P, v, M) -> idle share of the whole step, P pipeline positions (stages, or GPUs
    # when interleaved), with the formula as text (report.md)
    bubble_fraction: Callable[[int, int, int], float]
    bubble_formula: str
    # (P, v, M) -> idle time over the ideal (bubble-free) time, and its formula
    bubble_ratio: Callable[[int, int, int], float]
    bubble_ratio_formula: str
    # PipeDream: an update after every micro-batch's backward, a stashed weight copy per
    # micro-batch in flight (the runner's WEIGHT_STASHING; memory: params * in flight)
    stashes_weights: bool = False
    # v > 1 stage modules per GPU; the only kind that takes --virtual-stages
    interleaved: bool = False
    # the torch.distributed.pipelining class the torchrun pipeline runs it with (the
    # runtime's map, runtime/torch_schedules.py); None: the single-process runner only
    torch_class: str | None = None
    # each backward split into I (input gradient) and W (weight gradient), W deferred
    splits_backward: bool = False
    # two stage modules per GPU in a V: stage j and stage K - 1 - j on GPU j (v = 2)
    v_placed: bool = False
    # (K, v, M) -> per stage module, the micro-batches whose W waits at its peak, each
    # keeping what it needs (``Node.deferred_bytes``)
    deferred: Callable[[int, int, int], tuple[int, ...]] = lambda k, v, m: (0,) * k


# ----------------------------------------------------------- schedules that flush every step


def _flush_bubble(positions: int, virtual_stages: int, microbatches: int) -> float:
    """(K - 1) / (v*M + K - 1): fill and drain of a schedule that flushes every step."""
    return (positions - 1) / (virtual_stages * microbatches + positions - 1)


def _flush_ratio(positions: int, virtual_stages: int, microbatches: int) -> float:
    """(K - 1) / (v*M): Megatron-LM's bubble, over the ideal time."""
    return (positions - 1) / (virtual_stages * microbatches)


def _flushing(summary: str, *, table: Callable[[int, int, int], Table],
              flights: Callable[[int, int, int], tuple[int, ...]],
              interleaved: bool = False, stashes_weights: bool = False,
              torch_class: str | None = None) -> KindSpec:
    """A kind that flushes at the end of every step: its bubble is the fill and drain."""
    return KindSpec(
        summary=summary,
        table=table,
        flights=flights,
        bubble_fraction=_flush_bubble,
        bubble_formula="(K − 1) / (v·M + K − 1)",
        bubble_ratio=_flush_ratio,
        bubble_ratio_formula="(K − 1) / (v·M)",
        stashes_weights=stashes_weights,
        interleaved=interleaved,
        torch_class=torch_class,
    )


def _all_in_flight(num_stages: int, virtual_stages: int, microbatches: int) -> tuple[int, ...]:
    """Fill-drain: every stage holds all M micro-batches before its first backward."""
    return (microbatches,) * num_stages


def _warmup_in_flight(num_stages: int, virtual_stages: int, microbatches: int,
                      ) -> tuple[int, ...]:
    """1F1B: stage j runs min(M, K - j) forwards before its first backward."""
    return tuple(min(microbatches, num_stages - j) for j in range(num_stages))


@functools.cache
def _interleaved_in_flight(num_stages: int, virtual_stages: int, microbatches: int,
                           ) -> tuple[int, ...]:
    """Read off the table itself (Megatron-LM's warm-up of (N - d - 1) * 2 + (v - 1) * N
    forwards on GPU d) rather than a closed form: a different count per virtual stage."""
    return tuple(peak_in_flight(_interleaved_table(num_stages, virtual_stages, microbatches),
                                num_stages))


def _interleaved_table(num_stages: int, virtual_stages: int, microbatches: int) -> Table:
    return interleaved_1f1b(num_stages // virtual_stages, virtual_stages, microbatches)


# ------------------------------------------------------------------ zero-bubble schedules


def _zero_bubble_table(kind: str) -> Callable[[int, int, int], Table]:
    def table(num_stages: int, virtual_stages: int, microbatches: int) -> Table:
        if kind == "zb1p":
            return zb1p(num_stages, microbatches)
        if num_stages % 2:
            raise ValueError(f"the {kind} schedule places two stage modules per GPU: it needs "
                             f"an even number of stages, not {num_stages}")
        build = zbv if kind == "zbv" else dualpipev
        return build(num_stages // 2, microbatches)
    return table


@functools.cache
def _zero_bubble_peaks(kind: str, num_stages: int, microbatches: int,
                       ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(activations in flight, weight gradients waiting) per stage module, at their peaks,
    read off the table."""
    table = _zero_bubble_table(kind)(num_stages, 1, microbatches)
    return (tuple(peak_in_flight(table, num_stages)), tuple(peak_deferred(table, num_stages)))


def _zero_bubble(kind: str, *, chunks: int, summary: str, torch_class: str) -> KindSpec:
    """A kind that splits each backward into B and W, its W deferred into the bubbles;
    ``chunks``: stage modules per GPU (2: in a V). With F = I = W, a GPU idles K - 1 ticks
    of 3 v M + K - 1 (see ``zb1p``, ``zbv``)."""
    return KindSpec(
        summary=summary,
        table=_zero_bubble_table(kind),
        flights=lambda k, v, m: _zero_bubble_peaks(kind, k, m)[0],
        bubble_fraction=lambda p, v, m: (p - 1) / (3 * chunks * m + p - 1),
        bubble_formula="(K − 1)(T_F + T_B − T_W) per GPU, B the input gradient",
        bubble_ratio=lambda p, v, m: (p - 1) / (3 * chunks * m),
        bubble_ratio_formula="(K − 1)(T_F + T_B − T_W) / (M·(T_F + T_B + T_W))",
        torch_class=torch_class,
        splits_backward=True,
        v_placed=chunks == 2,
        deferred=lambda k, v, m: _zero_bubble_peaks(kind, k, m)[1],
    )


# ---------------------------------------------------------------------------- the kinds


KINDS: dict[ScheduleKind, KindSpec] = {
    ScheduleKind.GPIPE: _flushing(
        "GPipe fill-drain: all forwards, then all backwards",
        table=lambda k, v, m: gpipe(k, m),
        flights=_all_in_flight,
        torch_class=TORCH_SCHEDULES["gpipe"].class_name,
    ),
    ScheduleKind.ONE_F_ONE_B: _flushing(
        "1F1B with a flush at the end of the step (PipeDream-flush, Megatron-LM)",
        table=lambda k, v, m: one_f_one_b(k, m),
        flights=_warmup_in_flight,
        torch_class=TORCH_SCHEDULES["1f1b"].class_name,
    ),
    ScheduleKind.INTERLEAVED: _flushing(
        "Megatron-LM's interleaved 1F1B: {v} stage modules per GPU, stage j on GPU j mod {n}",
        table=_interleaved_table,
        flights=_interleaved_in_flight,
        interleaved=True,
        torch_class=TORCH_SCHEDULES["interleaved"].class_name,
    ),
    ScheduleKind.PIPEDREAM: _flushing(
        "PipeDream's 1F1B with weight stashing: each stage updates its weights "
        "after every micro-batch's backward, and a micro-batch's backward uses the weights "
        "its forward used (one stashed copy per micro-batch in flight)",
        table=lambda k, v, m: one_f_one_b(k, m),  # 1F1B's order, stashed weights
        flights=_warmup_in_flight,
        stashes_weights=True,
    ),
    ScheduleKind.ZB1P: _zero_bubble(
        "zb1p", chunks=1,
        summary="ZB-H1 (Zero Bubble, Qi et al. 2024): 1F1B's order and activation memory, "
        "each backward split into the input gradient (B, on the critical path) and the weight "
        "gradient (W), the weight gradients deferred into the bubbles",
        torch_class=TORCH_SCHEDULES["zb1p"].class_name,
    ),
    ScheduleKind.ZBV: _zero_bubble(
        "zbv", chunks=2,
        summary="ZB-V: two stage modules per GPU in a V (stage j and stage {k1} - j on GPU "
        "j), each backward split into B and W, the weight gradients filling the bubbles",
        torch_class=TORCH_SCHEDULES["zbv"].class_name,
    ),
    ScheduleKind.DUALPIPEV: _zero_bubble(
        "dualpipev", chunks=2,
        summary="DeepSeek's DualPipe-V: the V placement of ZB-V, one chunk's forward "
        "paired with the other's backward; priced as ZB-V (fxpipe does not generate the "
        "overlapped forward-backward that would hide communication)",
        torch_class=TORCH_SCHEDULES["dualpipev"].class_name,
    ),
}


def kind_of(name: str) -> ScheduleKind:
    """The kind called ``name`` (plan.json's ``schedule``)."""
    try:
        return ScheduleKind(name)
    except ValueError:
        names = [kind.value for kind in ScheduleKind]
        choices = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"
        raise ValueError(f"unknown schedule {name!r}; use {choices}") from None
