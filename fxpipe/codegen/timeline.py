"""Draw a pipeline schedule as a Gantt chart with predicted durations.

Each action of the clock-tick schedule starts as soon as its stage is free and
its dependencies have finished (F(j, m) after F(j-1, m); B(j, m) after F(j, m)
and B(j+1, m)), and lasts the stage's predicted forward or backward time, so
the idle gaps (the pipeline bubble) show at their true size::

    stage 0 | [F0][F1]            [B0 ][B1 ]
    stage 1 |     [F0][F1][B0 ][B1 ]
              ── time (s) ──►

The SVG is deterministic (fixed ``svg.hashsalt``, no date), so a committed
chart diffs cleanly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

__all__ = ["action_times", "draw_timeline"]

# K: number of stages, j: a stage, m: a micro-batch.

Action = tuple[int, str, int]  # (stage, "F" | "B", microbatch)

_COLOURS = {"F": "#4c72b0", "B": "#dd8452"}


def action_times(
    schedule: Sequence[Sequence[Action]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
) -> dict[Action, tuple[float, float]]:
    """(start, end) in seconds of every action, each stage running its actions
    in schedule order, each action as early as its dependencies allow."""
    num_stages = len(forward_s)
    if len(backward_s) != num_stages:
        raise ValueError(
            f"Got {num_stages} forward times and {len(backward_s)} backward times: "
            f"pass one of each per stage."
        )
    stage_free = [0.0] * num_stages
    times: dict[Action, tuple[float, float]] = {}
    for tick in schedule:
        for action in tick:
            j, kind, m = action
            if not 0 <= j < num_stages:
                raise ValueError(
                    f"Schedule action {action} names stage {j}, but times were given "
                    f"for {num_stages} stages."
                )
            deps = [(j - 1, "F", m)] if kind == "F" else [(j, "F", m), (j + 1, "B", m)]
            start = max([stage_free[j]] + [times[d][1] for d in deps if d in times])
            end = start + (forward_s[j] if kind == "F" else backward_s[j])
            times[action] = (start, end)
            stage_free[j] = end
    return times


def draw_timeline(
    schedule: Sequence[Sequence[Action]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    path: str | Path,
    *,
    title: str,
) -> float:
    """Write the schedule's Gantt chart to ``path`` (SVG) and return the
    predicted step time in seconds (the end of the last action)."""
    times = action_times(schedule, forward_s, backward_s)
    num_stages = len(forward_s)
    makespan = max((end for _start, end in times.values()), default=0.0)
    busy = sum(end - start for start, end in times.values())
    bubble = 1.0 - busy / (num_stages * makespan) if makespan > 0 else 0.0

    scale, unit = (1e3, "ms") if makespan < 1.0 else (1.0, "s")
    ticks_per_stage = len(times) / max(num_stages, 1)
    fig = Figure(figsize=(max(6.0, 0.35 * ticks_per_stage + 3), 1 + 0.5 * num_stages))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # One bar collection per (stage, kind): a chart of K x 2M boxes stays quick to draw.
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for (j, kind, m), (start, end) in sorted(times.items(), key=lambda kv: (kv[1][0], kv[0])):
        width = (end - start) * scale
        bars.setdefault((j, kind), []).append((start * scale, width))
        ax.text(start * scale + width / 2, j, str(m), ha="center", va="center",
                color="white", fontsize=7)
    for (j, kind), spans in sorted(bars.items()):
        ax.broken_barh(spans, (j - 0.4, 0.8), facecolors=_COLOURS[kind], edgecolor="white",
                       linewidth=0.8)
    ax.set_yticks(range(num_stages), [f"stage {j}" for j in range(num_stages)])
    ax.set_ylim(num_stages - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, makespan * scale if makespan > 0 else 1)
    ax.set_xlabel(f"predicted time ({unit})")
    ax.set_title(f"{title}  (step {makespan * scale:.3g} {unit}, bubble {bubble:.0%})",
                 fontsize=9)
    ax.legend(handles=[Patch(color=_COLOURS["F"], label="forward"),
                       Patch(color=_COLOURS["B"], label="backward")],
              loc="upper right", fontsize=7, ncols=2)
    fig.tight_layout()
    with matplotlib.rc_context({"svg.hashsalt": "fxpipe", "svg.fonttype": "none"}):
        fig.savefig(Path(path), format="svg", metadata={"Date": None})
    return makespan
