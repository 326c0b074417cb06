"""Draw a pipeline schedule as a Gantt chart with predicted durations.

Each action of the clock-tick schedule starts as soon as its device is free and
its dependencies have finished (F(j, m) after F(j-1, m); B(j, m) after F(j, m)
and B(j+1, m)), and lasts the stage's predicted forward or backward time, so
the idle gaps (the pipeline bubble) show at their true size::

    stage 0 | [F0][F1]            [B0 ][B1 ]
    stage 1 |     [F0][F1][B0 ][B1 ]
              ── time (s) ──►

A device is a stage unless ``devices`` maps stages to devices (interleaved 1F1B:
several virtual stages per GPU, which runs them one action at a time in schedule
order); the chart then has a row per GPU and labels each box with the
micro-batch and the chunk letter, as ``fxpipe.schedules.render_ascii`` does.

The SVG is deterministic (fixed ``svg.hashsalt``, no date), so a committed
chart diffs cleanly. ``schedule_svg`` draws a plan's chart (schedule.svg of the output
folder).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from fxpipe.runtime.schedule import Action, dependencies, events
from fxpipe.schedules import chunk_label
from fxpipe.units import format_seconds

if TYPE_CHECKING:
    from fxpipe.plan import Plan

__all__ = ["action_times", "bubble_fraction", "draw_timeline", "schedule_svg"]

# K: number of stages, j: a stage, d: a device, m: a micro-batch.

LABELLED_ACTIONS = 2048  # charts with more boxes draw them without micro-batch labels

_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#55a868"}
_LEGEND = {"F": "forward", "B": "backward", "I": "input gradient (B)",
           "W": "weight gradient (W)"}


def action_times(
    schedule: Sequence[Sequence[Action]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    devices: Sequence[int] | None = None,
    backward_weight_s: Sequence[float] | None = None,
) -> dict[Action, tuple[float, float]]:
    """(start, end) in seconds of every action, each device running its actions
    one at a time in schedule order, each action as early as its dependencies
    allow. ``devices[j]`` is stage j's device; by default each stage has its own.
    A zero-bubble table's I takes ``backward_s - backward_weight_s`` and its W
    ``backward_weight_s`` (all of a stage's backward is I if none is given)."""
    num_stages = len(forward_s)
    if len(backward_s) != num_stages:
        raise ValueError(
            f"Got {num_stages} forward times and {len(backward_s)} backward times: "
            f"pass one of each per stage."
        )
    weight = list(backward_weight_s) if backward_weight_s is not None else [0.0] * num_stages
    duration = {"F": list(forward_s), "B": list(backward_s), "W": weight,
                "I": [b - w for b, w in zip(backward_s, weight, strict=True)]}
    device_of = _device_of(devices, num_stages)
    device_free = [0.0] * (max(device_of, default=-1) + 1)
    times: dict[Action, tuple[float, float]] = {}
    finished: dict[Action, float] = {}  # when each event (see ``events``) happened
    for tick in schedule:
        for action in tick:
            j, kind, _ = action
            if not 0 <= j < num_stages:
                raise ValueError(
                    f"Schedule action {action} names stage {j}, but times were given "
                    f"for {num_stages} stages."
                )
            deps = dependencies(action, num_stages)
            start = max([device_free[device_of[j]]] + [finished[d] for d in deps if d in finished])
            end = start + duration[kind][j]
            times[action] = (start, end)
            finished.update((event, end) for event in events(action))
            device_free[device_of[j]] = end
    return times


def bubble_fraction(
    schedule: Sequence[Sequence[Action]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    devices: Sequence[int] | None = None,
    backward_weight_s: Sequence[float] | None = None,
) -> float:
    """The idle share of the whole step: the devices' idle time over (devices x step
    time), step time being the end of the last action (see ``action_times``)."""
    times = action_times(schedule, forward_s, backward_s, devices, backward_weight_s)
    return _bubble(times, len(set(_device_of(devices, len(forward_s)))))


def _bubble(times: dict[Action, tuple[float, float]], num_devices: int) -> float:
    makespan = max((end for _start, end in times.values()), default=0.0)
    busy = sum(end - start for start, end in times.values())
    return 1.0 - busy / (num_devices * makespan) if makespan > 0 else 0.0


def _device_of(devices: Sequence[int] | None, num_stages: int) -> list[int]:
    if devices is None:
        return list(range(num_stages))
    if len(devices) != num_stages or any(d < 0 for d in devices):
        raise ValueError(
            f"Got {len(devices)} devices for {num_stages} stages: pass one device "
            f"index (0, 1, ...) per stage."
        )
    return [int(d) for d in devices]


def draw_timeline(
    schedule: Sequence[Sequence[Action]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    path: str | Path,
    *,
    title: str,
    devices: Sequence[int] | None = None,
    backward_weight_s: Sequence[float] | None = None,
) -> float:
    """Write the schedule's Gantt chart to ``path`` (SVG) and return the
    predicted step time in seconds (the end of the last action). With ``devices``
    (stage j on device ``devices[j]``) the rows are devices, not stages. A
    zero-bubble table draws I and W apart (``backward_weight_s``: W's seconds)."""
    times = action_times(schedule, forward_s, backward_s, devices, backward_weight_s)
    num_stages = len(forward_s)
    row_of = _device_of(devices, num_stages)
    num_rows = max(row_of, default=-1) + 1
    # a row's chunks a, b, ... are its stages in order (as in schedules.render_ascii)
    suffix = [""] * num_stages
    if devices is not None:
        suffix = [chunk_label(row_of[:j].count(row_of[j])) for j in range(num_stages)]
    makespan = max((end for _start, end in times.values()), default=0.0)
    bubble = _bubble(times, len(set(row_of)))

    scale, unit = (1e3, "ms") if makespan < 1.0 else (1.0, "s")
    ticks_per_row = len(times) / max(num_rows, 1)
    fig = Figure(figsize=(max(6.0, 0.35 * ticks_per_row + 3), 1 + 0.5 * num_rows))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # One bar collection per (row, kind): a chart of K x 2M boxes stays quick to draw.
    # Text is what is slow (a layout per label, each drawn twice): a label per box only
    # up to LABELLED_ACTIONS boxes (32 GPUs x 128 micro-batches took 15-38 s with them),
    # and none of them in the layout pass (they sit inside the axes).
    labelled = len(times) <= LABELLED_ACTIONS
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for (j, kind, m), (start, end) in sorted(times.items(), key=lambda kv: (kv[1][0], kv[0])):
        width = (end - start) * scale
        bars.setdefault((row_of[j], kind), []).append((start * scale, width))
        if labelled:
            label = ax.text(start * scale + width / 2, row_of[j], f"{m}{suffix[j]}",
                            ha="center", va="center", color="white", fontsize=7)
            label.set_in_layout(False)
    for (row, kind), spans in sorted(bars.items()):
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=_COLOURS[kind], edgecolor="white",
                       linewidth=0.8)
    name = "stage" if devices is None else "gpu"
    ax.set_yticks(range(num_rows), [f"{name} {r}" for r in range(num_rows)])
    ax.set_ylim(num_rows - 0.5, -0.5)  # row 0 on top
    ax.set_xlim(0, makespan * scale if makespan > 0 else 1)
    ax.set_xlabel(f"predicted time ({unit})")
    ax.set_title(f"{title}  (step {format_seconds(makespan)}, bubble {bubble:.0%})",
                 fontsize=9)
    kinds = [k for k in _LEGEND if any(kind == k for _j, kind, _m in times)] or ["F", "B"]
    ax.legend(handles=[Patch(color=_COLOURS[k], label=_LEGEND[k]) for k in kinds],
              loc="upper right", fontsize=7, ncols=len(kinds))
    fig.tight_layout()
    with matplotlib.rc_context({"svg.hashsalt": "fxpipe", "svg.fonttype": "none"}):
        fig.savefig(Path(path), format="svg", metadata={"Date": None})
    return makespan


def schedule_svg(plan: Plan, schedule: Sequence[Sequence[Action]]) -> bytes:
    """The plan's schedule (its clock-tick table, ``schedule``) as a Gantt chart with the
    plan's predicted times: schedule.svg.

    Each stage's communication is split evenly between its forward (activations out)
    and its backward (gradients back).
    """
    forward = [s.forward_s + s.comm_s / 2 for s in plan.stages]
    backward = [s.backward_s + s.comm_s / 2 for s in plan.stages]
    devices = None
    if plan.virtual_stages > 1:  # one row per GPU, its stage modules in turn
        devices = [plan.devices_of(j)[0] for j in range(plan.num_stages)]
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "schedule.svg"
        title = f"{plan.model}: {plan.schedule}, K={plan.num_stages}, M={plan.microbatches}"
        draw_timeline(schedule, forward, backward, path, title=title, devices=devices,
                      backward_weight_s=[s.backward_weight_s for s in plan.stages])
        return path.read_bytes()
