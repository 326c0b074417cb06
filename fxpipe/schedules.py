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
For an interleaved table j is the virtual stage (K * v of them). A zero-bubble
table splits B into I (input gradient) and W (weight gradient): I keeps B's
dependencies, W(j, m) comes after I(j, m), and stage j's I or B waits for stage
j + 1's I or B.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from fxpipe.runtime.schedule import Action, check_schedule, dependencies, events

if TYPE_CHECKING:
    from fxpipe.plan import Plan

__all__ = [
    "KINDS",
    "Action",
    "KindSpec",
    "ScheduleKind",
    "Table",
    "chunk_label",
    "dualpipev",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_devices",
    "kind_of",
    "one_f_one_b",
    "peak_deferred",
    "peak_in_flight",
    "render_ascii",
    "schedule_table",
    "v_devices",
    "validate",
    "zb1p",
    "zbv",
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
        done.update(event for action in tick for event in events(action))
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
    """Raise AssertionError unless ``schedule`` runs, for every stage and micro-batch,
    its forward and either its full backward or its I and W, each exactly once, each
    device at most once per tick, and keeps every dependency. ``devices[j]`` is stage
    j's device; by default every stage has its own."""
    device_of = _device_list(devices, num_stages)
    for t, tick in enumerate(schedule):
        busy = [device_of[a[0]] for a in tick if 0 <= a[0] < num_stages]
        assert len(busy) == len(set(busy)), f"tick {t}: a device runs twice: {tick}"
    try:
        check_schedule(schedule, num_stages, microbatches)
    except ValueError as error:  # a table fxpipe built: an internal invariant
        raise AssertionError(str(error)) from None


def peak_in_flight(schedule: Sequence[Sequence[Action]], num_stages: int) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and whose backward (B, or its
    input gradient I) did not yet: the number of activation sets the stage holds at its
    peak. For an interleaved or V table the stages are the virtual stages."""
    return _peak(schedule, num_stages, {"F": 1, "B": -1, "I": -1})


def peak_deferred(schedule: Sequence[Sequence[Action]], num_stages: int) -> list[int]:
    """Per stage, the most micro-batches whose input gradient I ran and whose weight
    gradient W did not yet: how many sets of what W needs (``Node.deferred_bytes``) the
    stage keeps at its peak beyond its activations. 0 for a table without W."""
    return _peak(schedule, num_stages, {"I": 1, "W": -1})


def _peak(schedule: Sequence[Sequence[Action]], num_stages: int,
          change: dict[str, int]) -> list[int]:
    count = [0] * num_stages
    peak = [0] * num_stages
    for tick in schedule:
        for j, kind, _m in tick:
            count[j] += change.get(kind, 0)
            peak[j] = max(peak[j], count[j])
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


# ---------------------------------------------------------------- zero-bubble schedules
#
# A zero-bubble table runs each backward as two actions: I, the input gradient, which
# the previous stage waits for, and W, the weight gradient, which nothing waits for and
# which fills the bubbles (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24). Each
# action is one tick, so a table is drawn, simulated and checked with unit costs
# F = I = W; the per-GPU orders are torch.distributed.pipelining's (torch 2.13), so the
# single-process runner and torchrun run the same schedule.


def zb1p(num_stages: int, microbatches: int) -> Table:
    """ZB-H1 (torch's ``ScheduleInterleavedZeroBubble`` with one stage per GPU): 1F1B's
    order and activation memory (stage j holds min(M, K - j) micro-batches), the
    backward split into I and W, stage j holding its first j weight gradients back for
    the drain (so it keeps up to j + 1 micro-batches' ``deferred_bytes``). With
    F = I = W = one tick and M >= K each GPU idles K - 1 ticks of 3M + K - 1: the
    paper's (K - 1)(T_F + T_B - T_W), against 1F1B's (K - 1)(T_F + T_B + T_W).
    K = 3, M = 4::

        stage 0 | F0 F1 F2 .. .. I0 W0 F3 I1 W1 I2 W2 I3 W3
        stage 1 | .. F0 F1 .. I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
        stage 2 | .. .. F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3
    """
    _check_sizes(num_stages, microbatches)
    K, M = num_stages, microbatches
    orders: list[list[Action]] = []
    for j in range(K):
        warmup = min(K - 1 - j, M)  # forwards before the first backward
        order: list[Action] = [(j, "F", m) for m in range(warmup)]
        weights = 0  # W actions issued so far
        for i in range(M):  # the i-th input gradient, after the next forward if any
            if warmup + i < M:
                order.append((j, "F", warmup + i))
            order.append((j, "I", i))
            if i >= j:  # stage j lets j weight gradients wait for the drain
                order.append((j, "W", weights))
                weights += 1
        order += [(j, "W", m) for m in range(weights, M)]
        orders.append(order)
    return _to_ticks(orders, K)


def v_devices(num_devices: int) -> tuple[int, ...]:
    """The GPU of each of the 2K virtual stages in a V placement: stage j and stage
    2K - 1 - j on GPU j, so the model goes down the GPUs and back up, and the first and
    last stages (an embedding and its tied LM head) share GPU 0."""
    K = num_devices
    return tuple(j if j < K else 2 * K - 1 - j for j in range(2 * K))


def _check_v(num_devices: int, microbatches: int) -> None:
    if num_devices < 1:
        raise ValueError(f"Number of GPUs ({num_devices}) must be at least 1.")
    _check_sizes(2 * num_devices, microbatches)


def zbv(num_devices: int, microbatches: int) -> Table:
    """ZB-V (torch's ``ScheduleZBVZeroBubble``; the Zero Bubble paper, section 6): two
    V-placed chunks per GPU (``v_devices``), chunk 0 (stage d) and chunk 1 (stage
    2K - 1 - d) on GPU d, the backward split into I and W. A tick is one chunk's
    action, half a stage's of ZB-H1 on the same GPUs. With F = I = W and M >= 2K each
    GPU idles K - 1 ticks of 6M + K - 1, the fewest any table can (the last GPU starts
    at tick K - 1 and every GPU has 6M actions): ZB-H1's (K - 1)(T_F + T_B - T_W) in
    chunk times, half its bubble in time. Virtual stage s holds 2K - s micro-batches at
    its peak, so GPU d holds 2K + 1 chunks' activations, about 1F1B's first stage.
    K = 2, M = 2 (``a``: chunk 0, ``b``: chunk 1)::

        gpu 0 | F0a F1a ... F0b I0b W0b F1b I1b W1b I0a W0a ... I1a W1a
        gpu 1 | ... F0a F0b F1a F1b I0b W0b I0a W0a I1b W1b I1a W1a ...
    """
    _check_v(num_devices, microbatches)
    K, M = num_devices, microbatches
    n = max(2 * K - 1, M)  # torch fills the pipeline with at least 2K - 1, then drops them
    orders: list[list[Action]] = []
    for d in range(K):
        s0, s1 = d, 2 * K - 1 - d
        count = {(s, kind): 0 for s in (s0, s1) for kind in ("F", "I", "W")}
        order: list[Action] = []

        def add(stage: int, kind: str, order: list[Action] = order,
                count: dict[tuple[int, str], int] = count) -> None:
            m = count[stage, kind]
            count[stage, kind] += 1
            if m < M:
                order.append((stage, kind, m))

        for _ in range(2 * (K - d) - 1):  # warm-up: chunk 0 forwards
            add(s0, "F")
        for _ in range(d):
            add(s1, "F")
            add(s0, "F")
        for _ in range(K - d):  # chunk 1's first backwards, W at once
            add(s1, "F")
            add(s1, "I")
            add(s1, "W")
        while count[s1, "F"] < count[s0, "F"] or count[s0, "F"] < n:  # steady state
            if count[s0, "F"] < n:
                add(s0, "F")
            add(s0, "I")
            add(s0, "W")
            add(s1, "F")
            add(s1, "I")
            add(s1, "W")
        for _ in range(d):  # cool-down: input gradients first, weights after
            add(s0, "I")
            add(s1, "I")
        for _ in range(K - d):
            add(s0, "I")
            add(s0, "W")
        while count[s1, "W"] < count[s1, "I"]:
            add(s1, "W")
        while count[s0, "W"] < count[s0, "I"]:
            add(s0, "W")
        orders.append(order)
    return _to_ticks(orders, 2 * K)


def dualpipev(num_devices: int, microbatches: int) -> Table:
    """DualPipeV (DeepSeek-V3's DualPipe cut to a V, torch's ``ScheduleDualPipeV``): the
    V placement of ``zbv``, chunk 0's forward paired with chunk 1's backward and the
    reverse in the steady state, so that on a GPU one micro-batch's communication hides
    behind another's computation. Its overlapped forward-backward pairs and full
    backwards are written as their parts, in the order they run (F then I then W; a full
    backward is I then W at once), so the table has unit actions like the others.
    Needs M >= 2K. With F = I = W each GPU idles K - 1 ticks of 6M + K - 1, as ZB-V:
    its gain over ZB-V is the communication it hides, which a table of unit actions
    does not show. (DeepSeek's (PP/2 - 1)(F&B + B - 3W) counts an overlapped pair as one
    action of F + B; run as its parts, the packing fills K - 1 more of those ticks.)
    K = 2, M = 4::

        gpu 0 | F0a F1a F2a F0b I0b W0b F1b F3a I1b W1b F2b I0a W0a I2b W2b F3b I1a W1a ...
        gpu 1 | ... F0a F0b F1a F1b F2a I0b W0b F2b I0a W0a F3a I1b W1b F3b I1a W1a I2b ...
    """
    _check_v(num_devices, microbatches)
    K, M = num_devices, microbatches
    if M < 2 * K:
        raise ValueError(
            f"DualPipeV needs at least as many micro-batches ({M}) as stages ({2 * K}): "
            f"use --microbatches {2 * K}.")
    orders: list[list[Action]] = []
    for d in range(K):
        s0, s1 = d, 2 * K - 1 - d
        count = {(s, kind): 0 for s in (s0, s1) for kind in ("F", "I", "W")}
        pending: list[tuple[int, int]] = []  # (stage, micro-batch) whose W waits
        order: list[Action] = []

        def add(stage: int, kind: str, order: list[Action] = order,
                count: dict[tuple[int, str], int] = count,
                pending: list[tuple[int, int]] = pending) -> None:
            """F, I (its W queued), or "B": a full backward, written I then W."""
            key = "I" if kind == "B" else kind
            m = count[stage, key]
            count[stage, key] += 1
            order.append((stage, key, m))
            if kind == "B":
                order.append((stage, "W", m))
                count[stage, "W"] += 1
            elif kind == "I":
                pending.append((stage, m))

        def add_weight(order: list[Action] = order, count: dict[tuple[int, str], int] = count,
                       pending: list[tuple[int, int]] = pending) -> None:
            if pending:
                stage, m = pending.pop(0)
                order.append((stage, "W", m))
                count[stage, "W"] += 1

        for _ in range((K - d - 1) * 2):  # 1: chunk 0 forwards
            add(s0, "F")
        for _ in range(d + 1):  # 2: both chunks' forwards
            add(s0, "F")
            add(s1, "F")
        for _ in range(K - d - 1):  # 3: chunk 1 backward, zero-bubble style
            add(s1, "I")
            add_weight()
            add(s1, "F")
        for _ in range(M - 2 * K + d + 1):  # 4: F0 with B1, F1 with B0
            add(s0, "F")
            add(s1, "B")
            add(s1, "F")
            add(s0, "B")
        for _ in range(K - d - 1):  # 5: B1, then F1 with B0
            add(s1, "B")
            add(s1, "F")
            add(s0, "B")
        zero_bubble = False
        for i in range(d + 1):  # 6: both chunks' backwards, the second half split
            if i == (d + 1) // 2 and d % 2 == 1:
                zero_bubble = True
            add(s1, "I" if zero_bubble else "B")
            if i == (d + 1) // 2 and d % 2 == 0:
                zero_bubble = True
            add(s0, "I" if zero_bubble else "B")
        for _ in range(K - d - 1):  # 7: pending weights, chunk 0 backwards
            add_weight()
            add(s0, "I" if zero_bubble else "B")
        for _ in range(d + 1):  # 8: the last pending weights
            add_weight()
        while pending:
            add_weight()
        orders.append(order)
    return _to_ticks(orders, 2 * K)


# ---------------------------------------------------------------------------- the kinds


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
    # the torch.distributed.pipelining class the torchrun pipeline runs it with; None:
    # the single-process runner only
    torch_class: str | None = None
    # each backward split into I (input gradient) and W (weight gradient), W deferred
    splits_backward: bool = False
    # two stage modules per GPU in a V: stage j and stage K - 1 - j on GPU j (v = 2)
    v_placed: bool = False
    # (K, v, M) -> per stage module, the micro-batches whose W waits at its peak, each
    # keeping what it needs (``Node.deferred_bytes``)
    deferred: Callable[[int, int, int], tuple[int, ...]] = lambda k, v, m: (0,) * k


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


def _zero_bubble_table(kind: str) -> Callable[[int, int, int], Table]:
    def table(num_stages: int, virtual_stages: int, microbatches: int) -> Table:
        if kind == "zb1p":
            return zb1p(num_stages, microbatches)
        if num_stages % 2:
            raise ValueError(f"The {kind} schedule places two stage modules per GPU: it needs "
                             f"an even number of stages, not {num_stages}.")
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


def _zero_bubble_flights(kind: str) -> Callable[[int, int, int], tuple[int, ...]]:
    return lambda k, v, m: _zero_bubble_peaks(kind, k, m)[0]


def _zero_bubble_deferred(kind: str) -> Callable[[int, int, int], tuple[int, ...]]:
    return lambda k, v, m: _zero_bubble_peaks(kind, k, m)[1]


def _zero_bubble_fraction(chunks: int) -> Callable[[int, int, int], float]:
    """With F = I = W, a GPU idles K - 1 ticks of 3 v M + K - 1 (see ``zb1p``, ``zbv``)."""
    return lambda p, v, m: (p - 1) / (3 * chunks * m + p - 1)


def _zero_bubble_ratio(chunks: int) -> Callable[[int, int, int], float]:
    return lambda p, v, m: (p - 1) / (3 * chunks * m)


_ZB_BUBBLE = "(K − 1)(T_F + T_B − T_W) per GPU, B the input gradient"
_ZB_RATIO = "(K − 1)(T_F + T_B − T_W) / (M·(T_F + T_B + T_W))"
for _name, _chunks, _summary, _torch in (
    ("zb1p", 1, "ZB-H1 (Zero Bubble, Qi et al. 2024): 1F1B's order and activation memory, "
     "each backward split into the input gradient (B, on the critical path) and the weight "
     "gradient (W), the weight gradients deferred into the bubbles",
     "ScheduleInterleavedZeroBubble"),
    ("zbv", 2, "ZB-V: two stage modules per GPU in a V (stage j and stage {k1} - j on GPU "
     "j), each backward split into B and W, the weight gradients filling the bubbles",
     "ScheduleZBVZeroBubble"),
    ("dualpipev", 2, "DeepSeek's DualPipe-V: the V placement of ZB-V, one chunk's forward "
     "paired with the other's backward; priced as ZB-V (fxpipe does not generate the "
     "overlapped forward-backward that would hide communication)", "ScheduleDualPipeV"),
):
    KINDS[ScheduleKind(_name)] = KindSpec(
        summary=_summary,
        table=_zero_bubble_table(_name),
        flights=_zero_bubble_flights(_name),
        bubble_fraction=_zero_bubble_fraction(_chunks),
        bubble_formula=_ZB_BUBBLE,
        bubble_ratio=_zero_bubble_ratio(_chunks),
        bubble_ratio_formula=_ZB_RATIO,
        torch_class=_torch,
        splits_backward=True,
        v_placed=_chunks == 2,
        deferred=_zero_bubble_deferred(_name),
    )


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
