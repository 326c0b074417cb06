"""Pipeline schedules as clock-tick tables.

A schedule is a list of clock ticks; each tick is a tuple of the actions that
run concurrently in it, one per stage at most. An action is
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

Dependencies every valid schedule keeps (checked by ``validate``):
F(j, m) after F(j - 1, m); B(K - 1, m) after F(K - 1, m); B(j, m) after
B(j + 1, m) and after F(j, m); "after" meaning in a strictly earlier tick.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "Action",
    "Schedule",
    "gpipe",
    "one_f_one_b",
    "peak_in_flight",
    "render_ascii",
    "validate",
]

# K: number of stages, M: number of micro-batches, j: a stage, m: a micro-batch.

Action = tuple[int, str, int]  # (stage, "F" | "B", microbatch)
Schedule = list[tuple[Action, ...]]  # one tuple of concurrent actions per clock tick


def _check_sizes(num_stages: int, microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"Number of stages ({num_stages}) must be at least 1.")
    if microbatches < 1:
        raise ValueError(f"Number of micro-batches ({microbatches}) must be at least 1.")


def _deps(action: Action, num_stages: int) -> list[Action]:
    """The actions that must finish in an earlier tick before ``action`` runs."""
    j, kind, m = action
    if kind == "F":
        return [(j - 1, "F", m)] if j > 0 else []
    deps = [(j, "F", m)]
    if j < num_stages - 1:
        deps.append((j + 1, "B", m))
    return deps


def _to_ticks(orders: list[list[Action]], num_stages: int) -> Schedule:
    """Pack per-stage action orders into ticks, each action as early as its
    dependencies and its stage's previous action allow (unit time per action)."""
    done: set[Action] = set()
    cursor = [0] * num_stages
    ticks: Schedule = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        tick: list[Action] = []
        for j in range(num_stages):
            if cursor[j] == len(orders[j]):
                continue
            action = orders[j][cursor[j]]
            if all(d in done for d in _deps(action, num_stages)):
                tick.append(action)
        assert tick, f"schedule deadlocks after {len(ticks)} ticks"
        for action in tick:
            cursor[action[0]] += 1
        done.update(tick)
        remaining -= len(tick)
        ticks.append(tuple(tick))
    return ticks


def gpipe(num_stages: int, microbatches: int) -> Schedule:
    """Fill-drain: all forwards of all micro-batches, then all backwards."""
    _check_sizes(num_stages, microbatches)
    all_mb = range(microbatches)
    orders = [
        [(j, "F", m) for m in all_mb] + [(j, "B", m) for m in all_mb]
        for j in range(num_stages)
    ]
    return _to_ticks(orders, num_stages)


def one_f_one_b(num_stages: int, microbatches: int) -> Schedule:
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


def validate(schedule: Sequence[Sequence[Action]], num_stages: int, microbatches: int) -> None:
    """Raise AssertionError unless ``schedule`` runs every (stage, F/B, micro-batch)
    exactly once, each stage at most once per tick, and keeps every dependency."""
    tick_of: dict[Action, int] = {}
    for t, tick in enumerate(schedule):
        stages = [a[0] for a in tick]
        assert len(stages) == len(set(stages)), f"tick {t}: a stage runs twice: {tick}"
        for action in tick:
            j, kind, m = action
            assert 0 <= j < num_stages, f"tick {t}: stage {j} outside 0..{num_stages - 1}"
            assert kind in ("F", "B"), f"tick {t}: unknown action kind {kind!r}"
            assert 0 <= m < microbatches, f"tick {t}: micro-batch {m} outside 0..{microbatches - 1}"
            assert action not in tick_of, (
                f"tick {t}: {action} already ran in tick {tick_of[action]}"
            )
            tick_of[action] = t
    expected = {
        (j, kind, m) for j in range(num_stages) for kind in ("F", "B") for m in range(microbatches)
    }
    missing = sorted(expected - tick_of.keys())
    assert not missing, f"actions never run: {missing}"
    for action, t in tick_of.items():
        for dep in _deps(action, num_stages):
            assert tick_of[dep] < t, (
                f"{action} in tick {t} does not come after {dep} (tick {tick_of[dep]})"
            )


def peak_in_flight(schedule: Sequence[Sequence[Action]], num_stages: int) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and backward did not yet:
    the number of activation sets the stage holds at its peak."""
    in_flight = [0] * num_stages
    peak = [0] * num_stages
    for tick in schedule:
        for j, kind, _m in tick:
            in_flight[j] += 1 if kind == "F" else -1
            peak[j] = max(peak[j], in_flight[j])
    return peak


def render_ascii(
    schedule: Sequence[Sequence[Action]], num_stages: int, *, width: int | None = None
) -> str:
    """Rows are stages, columns are ticks; ``..`` marks an idle stage (a bubble).

    With ``width``, a schedule wider than that is drawn as several blocks of ticks,
    one under the other, each headed by the tick it starts at.
    """
    cell = max([2] + [len(f"{kind}{m}") for tick in schedule for _j, kind, m in tick])
    grid = [["." * cell] * len(schedule) for _ in range(num_stages)]
    for t, tick in enumerate(schedule):
        for j, kind, m in tick:
            grid[j][t] = f"{kind}{m}".ljust(cell)
    label = len(f"stage {num_stages - 1}")
    per_block = len(schedule) or 1
    if width is not None:
        per_block = max(1, (width - label - 3 + 1) // (cell + 1))
    blocks = []
    for start in range(0, max(len(schedule), 1), per_block):
        rows = [
            f"{f'stage {j}'.ljust(label)} | " + " ".join(row[start : start + per_block]).rstrip()
            for j, row in enumerate(grid)
        ]
        if per_block < len(schedule):
            rows.insert(0, f"{'tick'.ljust(label)} | {start}")
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks)
