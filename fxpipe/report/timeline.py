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

The SVG is written as text, element by element (a chart of 32 GPUs x 128 micro-batches
is 8,000 boxes: matplotlib took 2 s to draw it), and is deterministic, so a committed
chart diffs cleanly. ``schedule_svg`` draws a plan's chart (schedule.svg of the output
folder), with fewer micro-batches than the plan's where it has more than
``MAX_DRAWN_ACTIONS`` actions, and says so under the chart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

from fxpipe.runtime.schedule import Action, dependencies, events
from fxpipe.schedules import Table, chunk_label, kind_of
from fxpipe.units import format_seconds

if TYPE_CHECKING:
    from fxpipe.plan import Plan

__all__ = ["MAX_DRAWN_ACTIONS", "action_times", "bubble_fraction", "draw_timeline",
           "schedule_svg", "timeline_svg"]

# K: number of stages, j: a stage, d: a device, m: a micro-batch.

# The most actions schedule.svg draws, a box each: 1,000 stages with 1,024 micro-batches
# are 2,048,000 actions, half a minute's drawing and 158 MB of SVG; such a plan is drawn
# with as many of its micro-batches as fit, 20 (a second on a loaded machine, 3 MB).
MAX_DRAWN_ACTIONS = 40_000

# The chart's geometry in pixels: each row's height (its bars take _BAR of it), the
# margins around the rows, the width per action in a row (charts of many micro-batches
# are wide rather than crowded), and about what a character of the labels takes.
_ROW, _BAR = 28, 0.8
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 46, 44
_MIN_WIDTH, _PER_ACTION = 432.0, 25.0
_CHAR = 5.5
_NOTE = 20  # the height of the line under the chart
_FONT = "DejaVu Sans, Arial, sans-serif"

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
            f"got {num_stages} forward times and {len(backward_s)} backward times: "
            f"pass one of each per stage"
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
                    f"schedule action {action} names stage {j}, but times were given "
                    f"for {num_stages} stages"
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
            f"got {len(devices)} devices for {num_stages} stages: pass one device "
            f"index (0, 1, ...) per stage"
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
    svg, makespan = timeline_svg(schedule, forward_s, backward_s, title=title,
                                 devices=devices, backward_weight_s=backward_weight_s)
    Path(path).write_text(svg, encoding="utf-8")
    return makespan


def timeline_svg(
    schedule: Sequence[Sequence[Action]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    *,
    title: str,
    devices: Sequence[int] | None = None,
    backward_weight_s: Sequence[float] | None = None,
    note: str = "",
) -> tuple[str, float]:
    """``draw_timeline``'s chart as SVG text, and the predicted step time; ``note`` is a
    line under the chart."""
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
    width = max(_MIN_WIDTH, _PER_ACTION * len(times) / max(num_rows, 1), _CHAR * len(note))
    span = makespan * scale if makespan > 0 else 1.0
    x_of = width / span  # pixels per displayed time unit
    height = _TOP + _ROW * num_rows + _BOTTOM + (_NOTE if note else 0)
    out = [
        '<?xml version="1.0" encoding="utf-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + width + _RIGHT:.0f}" '
        f'height="{height}" font-family="{_FONT}">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{_LEFT}" y="18" font-size="12">'
        f"{escape(f'{title}  (step {format_seconds(makespan)}, bubble {bubble:.0%})')}</text>",
        *_legend([k for k in _LEGEND if any(kind == k for _j, kind, _m in times)] or ["F", "B"],
                 _LEFT + width),
    ]
    name = "stage" if devices is None else "gpu"
    for row in range(num_rows):
        middle = _TOP + _ROW * row + _ROW / 2
        out.append(f'<text x="{_LEFT - 6}" y="{middle:.1f}" font-size="10" '
                   f'text-anchor="end" dominant-baseline="central">{name} {row}</text>')
    out.append('<g stroke="white" stroke-width="0.8">')
    labels: list[str] = []
    for (j, kind, m), (start, end) in sorted(times.items(), key=lambda kv: (kv[1][0], kv[0])):
        left, box = _LEFT + start * scale * x_of, (end - start) * scale * x_of
        top = _TOP + _ROW * row_of[j] + _ROW * (1 - _BAR) / 2
        out.append(f'<rect x="{left:.2f}" y="{top:.1f}" width="{box:.2f}" '
                   f'height="{_ROW * _BAR:.1f}" fill="{_COLOURS[kind]}"/>')
        label = f"{m}{suffix[j]}"
        if box >= _CHAR * len(label) + 2:  # only where it fits inside the box
            labels.append(f'<text x="{left + box / 2:.2f}" y="{top + _ROW * _BAR / 2:.1f}">'
                          f"{label}</text>")
    out.append("</g>")
    if labels:
        out += ['<g font-size="8" fill="white" text-anchor="middle" '
                'dominant-baseline="central">', *labels, "</g>"]
    out += _axis(span, width, _TOP + _ROW * num_rows, unit)
    if note:
        out.append(f'<text x="{_LEFT}" y="{height - _NOTE / 2:.0f}" font-size="10">'
                   f"{escape(note)}</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n", makespan


def _legend(kinds: list[str], right: float) -> list[str]:
    """A swatch and a name per kind of action, in a line that ends at ``right``."""
    out: list[str] = []
    x = right
    for kind in reversed(kinds):
        text = _LEGEND[kind]
        x -= _CHAR * len(text) + 16
        out.append(f'<rect x="{x:.1f}" y="26" width="10" height="10" '
                   f'fill="{_COLOURS[kind]}"/>')
        out.append(f'<text x="{x + 14:.1f}" y="35" font-size="10">{escape(text)}</text>')
        x -= 10
    return out


def _axis(span: float, width: float, top: float, unit: str) -> list[str]:
    """The time axis under the rows: a line, ticks at round values, and its name."""
    step = _tick_step(span)
    out = [f'<line x1="{_LEFT}" y1="{top}" x2="{_LEFT + width:.2f}" y2="{top}" '
           'stroke="black" stroke-width="0.8"/>']
    for i in range(int(span / step + 1e-9) + 1):
        x = _LEFT + i * step * width / span
        out.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{top + 4}" '
                   'stroke="black" stroke-width="0.8"/>')
        out.append(f'<text x="{x:.2f}" y="{top + 15}" font-size="9" '
                   f'text-anchor="middle">{i * step:g}</text>')
    out.append(f'<text x="{_LEFT + width / 2:.2f}" y="{top + 32}" font-size="10" '
               f'text-anchor="middle">predicted time ({unit})</text>')
    return out


def _tick_step(span: float) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving at most about 10 ticks."""
    power = 10.0 ** math.floor(math.log10(span / 10))
    return next(power * f for f in (1, 2, 5, 10) if span / (power * f) <= 10)


def schedule_svg(plan: Plan) -> bytes:
    """The plan's schedule as a Gantt chart with the plan's predicted times:
    schedule.svg. A schedule of more than ``MAX_DRAWN_ACTIONS`` actions is drawn with
    fewer micro-batches, as many as fit, or not at all where even the fewest its kind
    allows are too many; a line under the chart says which.

    Each stage's communication is split evenly between its forward (activations out)
    and its backward (gradients back).
    """
    forward = [s.forward_s + s.comm_s / 2 for s in plan.stages]
    backward = [s.backward_s + s.comm_s / 2 for s in plan.stages]
    devices = None
    if plan.virtual_stages > 1:  # one row per GPU, its stage modules in turn
        devices = [plan.devices_of(j)[0] for j in range(plan.num_stages)]
    title = f"{plan.model}: {plan.schedule}, K={plan.num_stages}, M={plan.microbatches}"
    drawn, m, actions = _drawn_table(plan)
    if drawn is None:
        return _note_svg(title, f"The schedule's {actions:,} actions are too many to draw "
                                "(runner.py lists them).").encode("utf-8")
    note = ""
    if m < plan.microbatches:
        note = (f"Drawn with {m} of the plan's {plan.microbatches} micro-batches, as all "
                f"{actions:,} actions are too many to draw: the step and bubble above are "
                f"for {m}.")
    svg, _ = timeline_svg(drawn, forward, backward, title=title, devices=devices,
                          backward_weight_s=[s.backward_weight_s for s in plan.stages],
                          note=note)
    return svg.encode("utf-8")


def _drawn_table(plan: Plan) -> tuple[Table | None, int, int]:
    """The table schedule.svg draws, its micro-batches, and how many actions the plan's
    own table has: the plan's table, or one with as many micro-batches as
    ``MAX_DRAWN_ACTIONS`` allows (a multiple of the GPUs when interleaved), or None where
    the kind runs with no fewer than that."""
    spec = kind_of(plan.schedule).spec
    k, v, m = plan.num_stages, plan.virtual_stages, plan.microbatches
    per_microbatch = k * (3 if spec.splits_backward else 2)  # F and B, or F, I and W
    actions = per_microbatch * m
    if actions <= MAX_DRAWN_ACTIONS:
        return plan.schedule_table(), m, actions
    step = plan.num_devices if spec.interleaved else 1
    fewer = MAX_DRAWN_ACTIONS // per_microbatch // step * step
    if fewer < 1:
        return None, 0, actions
    try:
        return spec.table(k, v, fewer), fewer, actions
    except ValueError:  # fewer than the kind runs with (dualpipev: 2 per GPU)
        return None, 0, actions


def _note_svg(title: str, note: str) -> str:
    """A chart of nothing but its title and a line saying why."""
    width = _LEFT + max(_MIN_WIDTH, _CHAR * len(note)) + _RIGHT
    return "\n".join([
        '<?xml version="1.0" encoding="utf-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{_TOP + _NOTE}" '
        f'font-family="{_FONT}">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{_LEFT}" y="18" font-size="12">{escape(title)}</text>',
        f'<text x="{_LEFT}" y="{_TOP}" font-size="10">{escape(note)}</text>',
        "</svg>",
    ]) + "\n"
