"""A schedule as a clock-tick table: packing per-device orders into ticks, checking a
table, and reading off how much each stage holds at its peak.

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

from collections.abc import Sequence

from fxpipe.runtime.schedule import Action, check_schedule, dependencies, events

__all__ = ["Action", "Table", "check_sizes", "device_list", "peak_deferred", "peak_in_flight",
           "to_ticks", "validate"]

# K: number of stages, M: number of micro-batches, j: a stage, d: a device, m: a
# micro-batch.

Table = list[tuple[Action, ...]]  # one tuple of concurrent actions per clock tick


def check_sizes(num_stages: int, microbatches: int) -> None:
    """The check every table builder starts with: at least one stage and micro-batch."""
    if num_stages < 1:
        raise ValueError(f"number of stages ({num_stages}) must be at least 1")
    if microbatches < 1:
        raise ValueError(f"number of micro-batches ({microbatches}) must be at least 1")


def to_ticks(orders: list[list[Action]], num_stages: int) -> Table:
    """Pack per-device action orders into ticks: each tick, every device whose next
    action has its dependencies done runs it (unit time per action, one action per
    device per tick). ``orders[d]`` is device d's queue; without interleaving the
    devices are the stages.

    A device whose next action waits is looked at again only once the event it waits
    for has happened, so packing takes time in the actions, not ticks x devices (1,000
    stages of 1F1B: 10 s of rescanning idle stages)."""
    done: set[Action] = set()
    cursor = [0] * len(orders)
    waiting: dict[Action, list[int]] = {}  # an event -> the devices waiting for it
    candidates = {d for d, order in enumerate(orders) if order}
    ticks: Table = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        ready = []
        for d in sorted(candidates):
            missing = next((dep for dep in dependencies(orders[d][cursor[d]], num_stages)
                            if dep not in done), None)
            if missing is None:
                ready.append(d)
            else:
                waiting.setdefault(missing, []).append(d)
        assert ready, f"schedule deadlocks after {len(ticks)} ticks"
        tick = tuple(orders[d][cursor[d]] for d in ready)
        candidates = set()
        for d in ready:
            cursor[d] += 1
            if cursor[d] < len(orders[d]):
                candidates.add(d)
        for action in tick:
            for event in events(action):
                done.add(event)
                candidates.update(waiting.pop(event, ()))
        remaining -= len(tick)
        ticks.append(tick)
    return ticks


def device_list(devices: Sequence[int] | None, num_stages: int) -> list[int]:
    """``devices[j]``, stage j's device; by default every stage on its own."""
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
    device_of = device_list(devices, num_stages)
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
