"""The dependencies of a clock-tick schedule, and the check that a table keeps them.

# K: stages, M: micro-batches, j: a stage, m: a micro-batch.

A schedule is a list of clock ticks, each a tuple of ``(stage, "F" | "B", m)``
actions that may run at the same time. 1F1B with K = 3, M = 4::

    stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..
              ── tick ──►      Fm: forward of micro-batch m, Bm: its backward

F(j, m) runs after F(j - 1, m); B(j, m) after F(j, m) and B(j + 1, m), "after"
meaning in a strictly earlier tick. This module is the one statement of that
rule: the runner checks its table with it, and the compiler builds, validates
and times its tables with it.

Zero-bubble tables split a backward into I, the input gradient (what stage j - 1
waits for), and W, the weight gradient (what nothing waits for): I(j, m) keeps
B's dependencies, W(j, m) runs after I(j, m), and either B or I of stage j + 1
releases stage j. Each (j, m) runs F and B, or F, I and W.
"""

from collections.abc import Sequence
from typing import Any

__all__ = ["ACTIONS", "GRAD", "Action", "check_schedule", "check_sizes", "dependencies", "events"]

Action = tuple[int, str, int]  # (stage, "F" | "B" | "I" | "W", microbatch)

# Forward, full backward, and a backward's two halves (torch.distributed.pipelining's
# letters): I the input gradient, W the weight gradient.
ACTIONS = ("F", "B", "I", "W")
# Not an action: the event "stage j's input gradient of micro-batch m is ready", which
# either its full backward B or its I produces.
GRAD = "G"


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """The events (see ``events``) that must happen in an earlier tick before
    ``action`` runs."""
    j, kind, m = action
    if kind == "F":
        return [(j - 1, "F", m)] if j > 0 else []
    if kind == "W":
        return [(j, "I", m)]
    deps = [(j, "F", m)]
    if j < num_stages - 1:
        deps.append((j + 1, GRAD, m))
    return deps


def events(action: Action) -> list[Action]:
    """What running ``action`` makes happen: itself, and for B and I the gradient event."""
    j, kind, m = action
    return [action, (j, GRAD, m)] if kind in ("B", "I") else [action]


def check_schedule(schedule: Sequence[Sequence[Action]], num_stages: int, num_mb: int) -> None:
    """Raise ValueError unless the schedule runs, for each stage and micro-batch, F and
    B, or F, I and W, each once, in dependency order."""
    done: set[Action] = set()
    for t, tick in enumerate(schedule):
        this_tick: set[Action] = set()
        for action in tick:
            j, kind, m = action
            if not (0 <= j < num_stages and kind in ACTIONS and 0 <= m < num_mb):
                raise ValueError(
                    f"schedule tick {t} has {action}, outside {num_stages} stages x "
                    f"{num_mb} micro-batches: regenerate the schedule for this runner"
                )
            happened = events(action)
            if any(e in done or e in this_tick for e in happened):
                raise ValueError(f"schedule runs {action} twice (again in tick {t})")
            this_tick.update(happened)
            missing = [d for d in dependencies(action, num_stages) if d not in done]
            if missing:
                raise ValueError(f"schedule tick {t} runs {action} before {missing}")
        done.update(this_tick)
    for j in range(num_stages):
        for m in range(num_mb):
            ran = {kind for kind in ACTIONS if (j, kind, m) in done}
            if ran not in ({"F", "B"}, {"F", "I", "W"}):
                raise ValueError(
                    f"schedule runs {sorted(ran)} of stage {j}, micro-batch {m}: want F and "
                    f"B, or F, I and W ({num_stages} stages x {num_mb} micro-batches)"
                )


def check_sizes(num_stages: int, microbatches: int, devices: Sequence[Any] | None) -> None:
    """The runner's stage count, micro-batches and per-stage settings, checked."""
    if num_stages < 1:
        raise ValueError("PipelineRunner needs at least one stage")
    if microbatches < 1:
        raise ValueError(f"number of micro-batches ({microbatches}) must be at least 1")
    if devices is not None and len(devices) != num_stages:
        raise ValueError(
            f"got {len(devices)} devices for {num_stages} stages: pass one device per "
            f"stage (or devices=None to run every stage on the CPU in order)"
        )
