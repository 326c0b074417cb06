"""Pipeline schedules: the kinds fxpipe knows, and each as a clock-tick table.

This module owns the schedule kinds. ``KINDS`` holds, per ``ScheduleKind``, its
name (the CLI's ``--schedule`` choices and plan.json's ``schedule``), its tick
table builder, its in-flight rule (micro-batches each stage module holds at its
peak, which the solver's memory model reads), its bubble formula, whether it
stashes weights, whether it interleaves, and the torch.distributed.pipelining
schedule the torchrun pipeline runs it on. A new kind is one ``KINDS`` entry
plus its table builder and its in-flight rule.

A table is a list of clock ticks; each tick is a tuple of the actions that
run concurrently in it, one per device at most. An action is
``(stage, "F" | "B", microbatch)``. The runner executes the ticks in order, so
a table is both the plan and the program.

GPipe (fill-drain, Huang et al. 2019): every forward, then every backward.
K = 3, M = 4::

    stage 0 | F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3
    stage 1 | .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 ..
    stage 2 | .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. ..
    (``..`` is an idle stage: the bubble; every stage holds M activations)

1F1B with flush (PipeDream-flush, Megatron-LM): stage j runs min(K - j, M)
warm-up forwards, then alternates one backward and one forward, then drains
its remaining backwards. At most min(M, K - j) micro-batches are in flight
on stage j instead of M. K = 3, M = 4::

    stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..

Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM's
``forward_backward_pipelining_with_interleaving``): the model is cut into K * v
stages and GPU d runs the v "model chunks" d, K + d, 2K + d, ... (virtual stage
c * K + d is chunk c of GPU d). Each GPU runs forwards in groups of K
micro-batches, chunk after chunk, and backwards through the chunks in reverse:
min(v * M, 2 (K - d - 1) + (v - 1) K) warm-up forwards on GPU d, then one
forward and one backward at a time, then the remaining backwards. M must be a
multiple of K. The bubble shrinks v-fold, to (K - 1) / (v * M + K - 1) of the
step. Drawn one row per GPU, a cell is the kind, the micro-batch and the chunk
as a letter (``F1b``: forward of micro-batch 1 on chunk b, virtual stage K + d).
K = 2, v = 2, M = 4::

    gpu 0 | F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a ... B2b ... B3b B2a B3a
    gpu 1 | ... F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a ...
    (GPU 0 runs virtual stages 0 (a) and 2 (b), GPU 1 stages 1 (a) and 3 (b); 2
    idle ticks of 18 per GPU: (K - 1) / (v * M + K - 1) = 1/9. At their peaks
    virtual stages 0, 1, 2, 3 hold 4, 3, 2, 1 micro-batches' activations)

A GPU runs one action at a time, so a tick holds at most one action per GPU.

Dependencies every valid schedule keeps (``fxpipe.runtime.schedule``, the one
statement of them that the runner checks too; ``validate`` adds one action per
GPU per tick):
F(j, m) after F(j - 1, m); B(K - 1, m) after F(K - 1, m); B(j, m) after
B(j + 1, m) and after F(j, m); "after" meaning in a strictly earlier tick.
For an interleaved table j is the virtual stage (K * v of them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from fxpipe.runtime.schedule import Action, check_schedule, dependencies

if TYPE_CHECKING:
    from fxpipe.plan import Plan

__all__ = [
    "KINDS",
    "Action",
    "KindSpec",
    "ScheduleKind",
    "Table",
    "chunk_label",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_devices",
    "kind_of",
    "one_f_one_b",
    "peak_in_flight",
    "render_ascii",
    "schedule_table",
    "validate",
]

# K: number of stages (of GPUs when interleaved), M: number of micro-batches,
# v: virtual stages (model chunks) per GPU, j: a stage, d: a GPU, c: a chunk,
# m: a micro-batch.

Table = list[tuple[Action, ...]]  # one tuple of concurrent actions per clock tick


def _check_sizes(num_stages: int, microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"Number of stages ({num_stages}) must be at least 1.")
    if microbatches < 1:
        raise ValueError(f"Number of micro-batches ({microbatches}) must be at least 1.")


def _to_ticks(orders: list[list[Action]], num_stages: int) -> Table:
    """Pack per-device action orders into ticks: each tick, every device whose next
    action has its dependencies done runs it (unit time per action, one action per
    device per tick). ``orders[d]`` is device d's queue; without interleaving the
    devices are the stages."""
    done: set[Action] = set()
    cursor = [0] * len(orders)
    ticks: Table = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        ready = [
            d
            for d, order in enumerate(orders)
            if cursor[d] < len(order)
            and all(dep in done for dep in dependencies(order[cursor[d]], num_stages))
        ]
        assert ready, f"schedule deadlocks after {len(ticks)} ticks"
        tick = tuple(orders[d][cursor[d]] for d in ready)
        for d in ready:
            cursor[d] += 1
        done.update(tick)
        remaining -= len(tick)
        ticks.append(tick)
    return ticks


def gpipe(num_stages: int, microbatches: int) -> Table:
    """Fill-drain: all forwards of all micro-batches, then all backwards."""
    _check_sizes(num_stages, microbatches)
    all_mb = range(microbatches)
    orders = [
        [(j, "F", m) for m in all_mb] + [(j, "B", m) for m in all_mb]
        for j in range(num_stages)
    ]
    return _to_ticks(orders, num_stages)


def one_f_one_b(num_stages: int, microbatches: int) -> Table:
    """1F1B with a flush at the end of the step (PipeDream-flush / Megatron-LM)."""
    _check_sizes(num_stages, microbatches)
    orders: list[list[Action]] = []
    for j in range(num_stages):
        warmup = min(num_stages - j, microbatches)  # forwards before the first backward
        order: list[Action] = [(j, "F", m) for m in range(warmup)]
        for m in range(microbatches - warmup):  # steady state: B(m), F(m + warmup)
            order += [(j, "B", m), (j, "F", m + warmup)]
        order += [(j, "B", m) for m in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return _to_ticks(orders, num_stages)


def interleaved_devices(num_devices: int, virtual_stages: int) -> tuple[int, ...]:
    """The GPU of each of the K * v virtual stages: round robin, stage j on GPU j % K."""
    return tuple(j % num_devices for j in range(num_devices * virtual_stages))


def interleaved_1f1b(num_devices: int, virtual_stages: int, microbatches: int) -> Table:
    """Megatron-LM's interleaved 1F1B over K GPUs with v model chunks each; actions name
    the virtual stage c * K + d (see ``interleaved_devices``). With v = 1 it is
    ``one_f_one_b`` (Megatron then runs its schedule without interleaving)."""
    K, v, M = num_devices, virtual_stages, microbatches
    if K < 1:
        raise ValueError(f"Number of GPUs ({K}) must be at least 1.")
    if v < 1:
        raise ValueError(
            f"Number of virtual stages per GPU ({v}) must be at least 1 (1: plain 1F1B)."
        )
    _check_sizes(K * v, M)
    if v > 1 and M % K:
        raise ValueError(
            f"Interleaved 1F1B needs the micro-batches ({M}) to be a multiple of the GPUs "
            f"({K}): use --microbatches {-(-M // K) * K}."
        )
    total = M * v  # actions of each kind per GPU

    def forward(d: int, i: int) -> Action:
        # forward number i: groups of K micro-batches, chunk after chunk
        c = (i // K) % v
        return (c * K + d, "F", (i // (K * v)) * K + i % K)

    def backward(d: int, i: int) -> Action:
        # backward number i: the same micro-batch groups, the chunks in reverse
        c = v - 1 - (i // K) % v
        return (c * K + d, "B", (i // (K * v)) * K + i % K)

    orders: list[list[Action]] = []
    for d in range(K):
        # Warm-up forwards on GPU d. Without interleaving Megatron runs K - d - 1 (its
        # steady state starts with a forward). With it, Megatron-core runs two per GPU
        # after d (the forwards that fit while micro-batch 0 goes down to the last GPU
        # and its gradient comes back, a tick per GPU each way) plus a group of K for
        # every chunk but the last. (Megatron-LM before core ran every forward first
        # when M == K; core does not.)
        warmup = K - d - 1 if v == 1 else (K - d - 1) * 2 + (v - 1) * K
        warmup = min(warmup, total)
        order = [forward(d, i) for i in range(warmup)]
        for i in range(total - warmup):  # steady state: one forward, one backward
            order += [forward(d, warmup + i), backward(d, i)]
        order += [backward(d, i) for i in range(total - warmup, total)]
        orders.append(order)
    return _to_ticks(orders, K * v)


def _device_list(devices: Sequence[int] | None, num_stages: int) -> list[int]:
    if devices is None:
        return list(range(num_stages))
    assert len(devices) == num_stages, f"{len(devices)} devices for {num_stages} stages"
    return [int(d) for d in devices]


def validate(
    schedule: Sequence[Sequence[Action]],
    num_stages: int,
    microbatches: int,
    devices: Sequence[int] | None = None,
) -> None:
    """Raise AssertionError unless ``schedule`` runs every (stage, F/B, micro-batch)
    exactly once, each device at most once per tick, and keeps every dependency.
    ``devices[j]`` is stage j's device; by default every stage has its own."""
    device_of = _device_list(devices, num_stages)
    for t, tick in enumerate(schedule):
        busy = [device_of[a[0]] for a in tick if 0 <= a[0] < num_stages]
        assert len(busy) == len(set(busy)), f"tick {t}: a device runs twice: {tick}"
    try:
        check_schedule(schedule, num_stages, microbatches)
    except ValueError as error:  # a table fxpipe built: an internal invariant
        raise AssertionError(str(error)) from None


def peak_in_flight(schedule: Sequence[Sequence[Action]], num_stages: int) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and backward did not yet:
    the number of activation sets the stage holds at its peak. For an interleaved
    table the stages are the K * v virtual stages."""
    in_flight = [0] * num_stages
    peak = [0] * num_stages
    for tick in schedule:
        for j, kind, _m in tick:
            in_flight[j] += 1 if kind == "F" else -1
            peak[j] = max(peak[j], in_flight[j])
    return peak


def chunk_label(c: int) -> str:
    """Chunk 0, 1, ..., 25, 26, ... as a, b, ..., z, aa, ... (spreadsheet columns)."""
    label = ""
    c += 1
    while c:
        c, rest = divmod(c - 1, 26)
        label = chr(ord("a") + rest) + label
    return label


def render_ascii(
    schedule: Sequence[Sequence[Action]],
    num_stages: int,
    *,
    width: int | None = None,
    devices: Sequence[int] | None = None,
) -> str:
    """Rows are stages, columns are ticks; ``..`` marks an idle stage (a bubble).

    With ``devices`` (``devices[j]``: stage j's device, several stages to a device as
    in interleaved 1F1B), rows are devices, ``gpu d``, and each cell names the chunk
    after the micro-batch: ``F3b`` is the forward of micro-batch 3 on the device's
    second stage (chunks a, b, ... in stage order). With ``width``, a schedule wider
    than that is drawn as several blocks of ticks, one under the other, each headed
    by the tick it starts at.
    """
    if devices is None:
        row_of = list(range(num_stages))
        rows = [f"stage {j}" for j in row_of]
        suffix = [""] * num_stages
    else:
        row_of = _device_list(devices, num_stages)
        rows = [f"gpu {d}" for d in range(max(row_of, default=-1) + 1)]
        chunk_of = [sum(1 for i in range(j) if row_of[i] == row_of[j]) for j in range(num_stages)]
        suffix = [chunk_label(c) for c in chunk_of]
    cell = max([2] + [len(f"{kind}{m}{suffix[j]}") for tick in schedule for j, kind, m in tick])
    grid = [["." * cell] * len(schedule) for _ in rows]
    for t, tick in enumerate(schedule):
        for j, kind, m in tick:
            grid[row_of[j]][t] = f"{kind}{m}{suffix[j]}".ljust(cell)
    label = max((len(r) for r in rows), default=0)
    per_block = len(schedule) or 1
    if width is not None:
        per_block = max(1, (width - label - 3 + 1) // (cell + 1))
    blocks = []
    for start in range(0, max(len(schedule), 1), per_block):
        lines = [
            f"{name.ljust(label)} | " + " ".join(row[start : start + per_block]).rstrip()
            for name, row in zip(rows, grid, strict=True)
        ]
        if per_block < len(schedule):
            lines.insert(0, f"{'tick'.ljust(label)} | {start}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# ---------------------------------------------------------------------------- the kinds


class ScheduleKind(str, Enum):
    """A schedule by name; ``KINDS[kind]`` (or ``kind.spec``) says how it behaves."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    PIPEDREAM = "pipedream"

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
    # the torch.distributed.pipelining class the torchrun pipeline runs it with; None:
    # the single-process runner only
    torch_class: str | None = None


def _flush_bubble(positions: int, virtual_stages: int, microbatches: int) -> float:
    """(K - 1) / (v*M + K - 1): fill and drain of a schedule that flushes every step."""
    return (positions - 1) / (virtual_stages * microbatches + positions - 1)


def _flush_ratio(positions: int, virtual_stages: int, microbatches: int) -> float:
    """(K - 1) / (v*M): Megatron-LM's bubble, over the ideal time."""
    return (positions - 1) / (virtual_stages * microbatches)


_FLUSH_BUBBLE = "(K − 1) / (v·M + K − 1)"
_FLUSH_RATIO = "(K − 1) / (v·M)"


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


KINDS: dict[ScheduleKind, KindSpec] = {
    ScheduleKind.GPIPE: KindSpec(
        summary="GPipe fill-drain: all forwards, then all backwards",
        table=lambda k, v, m: gpipe(k, m),
        flights=_all_in_flight,
        bubble_fraction=_flush_bubble,
        bubble_formula=_FLUSH_BUBBLE,
        bubble_ratio=_flush_ratio,
        bubble_ratio_formula=_FLUSH_RATIO,
        torch_class="ScheduleGPipe",
    ),
    ScheduleKind.ONE_F_ONE_B: KindSpec(
        summary="1F1B with a flush at the end of the step (PipeDream-flush, Megatron-LM)",
        table=lambda k, v, m: one_f_one_b(k, m),
        flights=_warmup_in_flight,
        bubble_fraction=_flush_bubble,
        bubble_formula=_FLUSH_BUBBLE,
        bubble_ratio=_flush_ratio,
        bubble_ratio_formula=_FLUSH_RATIO,
        torch_class="Schedule1F1B",
    ),
    ScheduleKind.INTERLEAVED: KindSpec(
        summary="Megatron-LM's interleaved 1F1B: {v} stage modules per GPU, stage j on "
        "GPU j mod {n}",
        table=_interleaved_table,
        flights=_interleaved_in_flight,
        bubble_fraction=_flush_bubble,
        bubble_formula=_FLUSH_BUBBLE,
        bubble_ratio=_flush_ratio,
        bubble_ratio_formula=_FLUSH_RATIO,
        interleaved=True,
        torch_class="ScheduleInterleaved1F1B",
    ),
    ScheduleKind.PIPEDREAM: KindSpec(
        summary="PipeDream's 1F1B with weight stashing: each stage updates its weights "
        "after every micro-batch's backward, and a micro-batch's backward uses the weights "
        "its forward used (one stashed copy per micro-batch in flight)",
        table=lambda k, v, m: one_f_one_b(k, m),  # 1F1B's order, stashed weights
        flights=_warmup_in_flight,
        bubble_fraction=_flush_bubble,
        bubble_formula=_FLUSH_BUBBLE,
        bubble_ratio=_flush_ratio,
        bubble_ratio_formula=_FLUSH_RATIO,
        stashes_weights=True,
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


def schedule_table(plan: Plan) -> Table:
    """The plan's schedule as a clock-tick table over its stage modules."""
    k, v = plan.num_stages, plan.virtual_stages
    spec = kind_of(plan.schedule).spec
    if spec.interleaved and plan.num_devices * v != k:
        raise ValueError(
            f"an interleaved plan on {plan.num_devices} GPUs with {v} virtual stages each "
            f"has {plan.num_devices * v} stages, not {k}"
        )
    return spec.table(k, v, plan.microbatches)
