"""report.html: the plan drawn for a person, one file that needs nothing else to open.

Four drawings, each inline SVG written as text (as ``timeline.py`` writes schedule.svg),
under one stylesheet in the page; no script, no font or image fetched:

- the model's own layers, stage by stage (``layers.py``): which modules each stage holds,
  each cut named by the modules either side of it, and what crosses it;
- memory per GPU, a stacked bar of ``StageMemory``'s kinds each, against the limit;
- the schedule's timeline: schedule.svg, inline;
- the plan beside the baselines: bottleneck, iteration, largest GPU, whether each fits.

Byte-identical from run to run: nothing read from the clock, every list in plan or graph
order. Graphviz is not needed.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields
from html import escape

import torch.fx

from fxpipe.plan import Layout, Plan, StageMemory
from fxpipe.report.diagram import PALETTE
from fxpipe.report.layers import Cut, Layer, cuts, stage_layers
from fxpipe.report.layouts import layout_sentence, layout_table
from fxpipe.report.markdown import compared, overview, summary_rows
from fxpipe.report.timeline import schedule_svg
from fxpipe.units import format_bytes, format_ms

__all__ = ["render_html"]

# The stages' colours: PALETTE (the partition diagram's) behind a stage, these on its bars.
_STRONG = ("#6fa8dc", "#93c47d", "#f1c232", "#e06666", "#8e7cc3", "#f6b26b", "#76a5af",
           "#c27ba0")
# StageMemory's kinds in the order the bars stack them: field, name, colour
_KINDS = (
    ("params", "parameters", "#4c72b0"),
    ("grads", "gradients", "#86a9d8"),
    ("optimizer", "optimizer state", "#8172b3"),
    ("activations", "activations", "#dd8452"),
    ("received", "received", "#ccb974"),
    ("outputs", "outputs", "#55a868"),
    ("loss", "loss", "#e5ae38"),
    ("backward", "backward", "#da8bc3"),
    ("stashed", "stashed weights", "#937860"),
    ("deferred", "deferred W", "#8c8c8c"),
    ("workspace", "workspace", "#c7c7c7"),
)
assert sorted(k for k, _, _ in _KINDS) == sorted(f.name for f in fields(StageMemory))
_LIMIT = "#b00020"  # the memory limit's line, and what does not fit
# A limit more than this many times the fullest GPU is not drawn to scale (its bars
# would be slivers): a line under the chart says where it is.
_OFF_SCALE = 4.0
_WIDTH = 1000  # every drawing's width in pixels
_CHAR = 0.6  # about what a character takes, in font sizes

_STYLE = """
body { font-family: "DejaVu Sans", Arial, sans-serif; color: #222; background: #fff;
       max-width: 1040px; margin: 24px auto; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 8px; }
h2 { font-size: 17px; margin-top: 32px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
p, li { font-size: 13px; line-height: 1.45; }
ul.overview { padding-left: 18px; color: #333; }
.wide { overflow-x: auto; }
svg { display: block; }
svg text { font-family: "DejaVu Sans", Arial, sans-serif; }
table { border-collapse: collapse; font-size: 13px; margin-top: 12px; }
th, td { padding: 4px 12px; border-bottom: 1px solid #e5e5e5; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.no { color: #b00020; font-weight: bold; }
.foot { color: #666; margin-top: 32px; }
"""


def render_html(plan: Plan, gm: torch.fx.GraphModule, *, depth: int,
                schedule: str | bytes | None = None) -> str:
    """report.html for ``plan`` of ``gm`` (its nodes annotated: modules, times, shapes),
    the layers grouped ``depth`` module levels down; ``schedule``: schedule.svg, where
    already drawn."""
    timeline = schedule_svg(plan) if schedule is None else schedule
    timeline = timeline.decode("utf-8") if isinstance(timeline, bytes) else timeline
    timeline = _enlarged(timeline[timeline.index("<svg"):])
    body = [
        f"<h1>fxpipe plan: {escape(plan.model)}</h1>",
        '<ul class="overview">', *(f"<li>{escape(line)}</li>" for line in overview(plan)),
        *([f"<li>layout: {escape(layout_sentence(plan.layout))}</li>"] if plan.layout else []),
        "</ul>",
        *_layouts(plan.layout),
        "<h2>The model's layers, stage by stage</h2>",
        "<p>Each band is a stage, its rows the model's modules in the order they run; a "
        "layer a cut goes through lists the parts of it the stage holds. The bars are "
        "each row's forward and backward time for one micro-batch. Each cut is named by "
        "the modules of the last op before it and the first after it, and says what "
        "crosses it.</p>",
        _layers_svg(plan, stage_layers(gm, plan, depth=depth), cuts(gm, plan)),
        "<h2>Memory per GPU</h2>",
        "<p>What each GPU holds at its peak, by kind, against the memory limit (hover over "
        "a part for its size).</p>",
        _memory_svg(plan),
        "<h2>Schedule</h2>",
        "<p>Each GPU's forward and backward actions with the predicted times; the gaps "
        "are the pipeline bubble.</p>",
        f'<div class="wide">{timeline}</div>',
        "<h2>Against the baselines</h2>",
        "<p>The same model under the same cost model, cut by each baseline.</p>",
        _baselines_svg(plan),
        _baselines_table(plan),
    ]
    if plan.notes:
        body += ["<h2>Notes</h2>", "<ul>", *(f"<li>{escape(n)}</li>" for n in plan.notes),
                 "</ul>"]
    body.append('<p class="foot">Predicted by fxpipe from its cost model; report.md has '
                "the same figures as tables, plan.json all of them.</p>")
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        '<head><meta charset="utf-8"/>',
        f"<title>fxpipe plan: {escape(plan.model)}</title>",
        f"<style>{_STYLE}</style></head>",
        "<body>", *body, "</body>", "</html>", "",
    ])


def _enlarged(svg: str) -> str:
    """schedule.svg's chart, its root named "schedule", drawn the page's width where that
    takes 0.75 to 1.3 times its size (a chart wider still scrolls)."""
    found = re.match(r'<svg ([^>]*?)width="([\d.]+)" height="([\d.]+)"', svg)
    assert found is not None, svg[:200]
    attributes, width, height = found.group(1), float(found.group(2)), float(found.group(3))
    scale = min(_WIDTH / width, 1.3) if _WIDTH / width >= 0.75 else 1.0
    return (f'<svg id="schedule" {attributes}width="{width * scale:.0f}" '
            f'height="{height * scale:.0f}" viewBox="0 0 {width:.0f} {height:.0f}"'
            + svg[found.end():])


def _svg(name: str, height: float, parts: list[str]) -> str:
    return "\n".join([f'<svg id="{name}" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" '
                      f'height="{height:.0f}" viewBox="0 0 {_WIDTH} {height:.0f}">',
                      *parts, "</svg>"])


def _text(x: float, y: float, text: str, *, size: int = 11, extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}"{extra}>'
            f"{escape(text)}</text>")


def _clip(text: str, width: float, size: int = 11) -> str:
    """``text`` cut to about ``width`` pixels, with an ellipsis where cut."""
    most = int(width / (_CHAR * size))
    return text if len(text) <= most else text[: max(most - 1, 1)] + "…"


def _gpus_of(plan: Plan) -> list[list[int]]:
    """Each GPU's stage modules."""
    return [[j for j in range(plan.num_stages) if d in plan.devices_of(j)]
            for d in range(plan.num_devices)]


# The layer bands' geometry: a row's height (a cut layer's takes a second line for its
# parts), the columns' left edges, the gap a cut takes.
_ROW, _PARTS, _CUT = 20, 14, 48
_NAME_X, _OPS_X, _BAR_X, _BAR_W = 150, 680, 700, 200


def _layers_svg(plan: Plan, layers: list[list[Layer]], cut: list[Cut]) -> str:
    slowest = max((row.seconds for rows in layers for row in rows), default=0.0) or 1.0
    out = [_text(8, 14, "stage", extra=' fill="#666"'),
           _text(_NAME_X, 14, "layers (module, class; where a cut goes through a layer, "
                 "the parts of it held)", extra=' fill="#666"'),
           _text(_OPS_X, 14, "ops", extra=' fill="#666" text-anchor="end"'),
           _text(_BAR_X, 14, "forward + backward, one micro-batch", extra=' fill="#666"')]
    y = 24.0
    for j, rows in enumerate(layers):
        stage = plan.stages[j]
        rows = rows or [Layer("(nothing)", "", (), 0, 0.0)]
        height = max(sum(_ROW + _PARTS * bool(row.parts) for row in rows), 62) + 10
        gpus = ", ".join(str(d) for d in plan.devices_of(j))
        out += [f'<rect x="0" y="{y:.1f}" width="{_WIDTH}" height="{height}" rx="4" '
                f'fill="{PALETTE[j % len(PALETTE)]}"/>',
                _text(8, y + 18, f"stage {j}", size=13, extra=' font-weight="bold"'),
                _text(8, y + 34, f"GPU{'s' * (len(plan.devices_of(j)) > 1)} {gpus}"),
                _text(8, y + 49, f"fwd+bwd {format_ms(stage.forward_s + stage.backward_s)}"),
                _text(8, y + 64, format_bytes(stage.memory.total))]
        top = y + 5
        for row in rows:
            out += _layer_row(row, top, _STRONG[j % len(_STRONG)], slowest)
            top += _ROW + _PARTS * bool(row.parts)
        y += height
        if j < len(cut):
            out += _cut_lines(cut[j], y)
            y += _CUT
    return _svg("layers", y + 4, out)


def _layer_row(row: Layer, top: float, colour: str, slowest: float) -> list[str]:
    """A layer's name and class, the parts of it held on a second line where it is cut,
    its ops and its time."""
    middle = top + _ROW / 2 + 4
    name = row.name or "(the model's own ops)"
    kind = f"{row.count} × {row.type_name}" if row.count > 1 else row.type_name
    parts = "holds " + ", ".join(row.parts)
    room = _OPS_X - 30 - _NAME_X
    out = [f"<g><title>{escape(' '.join([name, kind] + [parts] * bool(row.parts)))}</title>",
           f'<text x="{_NAME_X}" y="{middle:.1f}" font-size="11">'
           f'<tspan font-weight="bold">{escape(_clip(name, room))}</tspan>'
           + (f'<tspan fill="#555" dx="8">{escape(_clip(kind, room - _CHAR * 11 * len(name)))}'
              "</tspan>" if kind and _CHAR * 11 * len(name) < room - 40 else "") + "</text>",
           _text(_OPS_X, middle, str(row.ops), extra=' text-anchor="end"')]
    if row.parts:
        out.append(_text(_NAME_X + 12, middle + _PARTS, _clip(parts, room - 12, 10), size=10,
                         extra=' fill="#555"'))
    width = row.seconds / slowest * _BAR_W
    if row.seconds > 0:
        out.append(f'<rect x="{_BAR_X}" y="{top + 4:.1f}" width="{max(width, 1):.1f}" '
                   f'height="{_ROW - 8}" fill="{colour}"/>')
        out.append(_text(_BAR_X + max(width, 1) + 6, middle, format_ms(row.seconds), size=10))
    out.append("</g>")
    return out


def _cut_lines(cut: Cut, top: float) -> list[str]:
    """A dashed line across, the modules either side of it, and what crosses it (the
    largest values first)."""
    largest = sorted(cut.values, key=lambda value: -value[2])  # stable: graph order in ties
    shown = [f"{name} ({path or 'the model itself'}) {format_bytes(nbytes)}"
             for name, path, nbytes in largest[:4]]
    if len(largest) > 4:
        shown.append(f"and {len(largest) - 4} more")
    own = "the model's own ops"
    heading = (f"cut between {cut.last or own} and {cut.first or own}: "
               f"{format_bytes(cut.nbytes)} per micro-batch in {len(cut.values)} value"
               f"{'s' * (len(cut.values) != 1)}")
    values = "sends " + ", ".join(shown)
    return [f'<line x1="0" y1="{top + 9:.1f}" x2="{_WIDTH}" y2="{top + 9:.1f}" '
            f'stroke="{_LIMIT}" stroke-width="1.5" stroke-dasharray="6 4"/>',
            f"<g><title>{escape(heading)}; {escape(values)}</title>",
            _text(8, top + 25, _clip(heading, _WIDTH - 16), extra=f' fill="{_LIMIT}"'),
            *([_text(20, top + 40, _clip(values, _WIDTH - 28, 10), size=10,
                     extra=f' fill="{_LIMIT}"')] if shown else []),
            "</g>"]


# The memory bars' geometry: label column, bar area, row height.
_MEM_X, _MEM_W, _MEM_ROW = 150, 640, 30


def _memory_svg(plan: Plan) -> str:
    gpus = _gpus_of(plan)
    held = [[sum(getattr(plan.stages[j].memory, kind) for j in stages)
             for kind, _, _ in _KINDS] for stages in gpus]
    fullest = max((sum(kinds) for kinds in held), default=0) or 1
    limit = plan.memory_limit
    drawn = math.isfinite(limit) and limit <= _OFF_SCALE * fullest
    scale = max(fullest, limit) if drawn else fullest
    used = [i for i in range(len(_KINDS)) if any(kinds[i] for kinds in held)]
    out, y = _legend([(_KINDS[i][1], _KINDS[i][2]) for i in used], 8.0)
    y += 18
    top = y
    for d, (stages, kinds) in enumerate(zip(gpus, held, strict=True)):
        middle = y + _MEM_ROW / 2
        out += [_text(8, middle, f"GPU {d}", size=12, extra=' font-weight="bold"'),
                _text(60, middle, _clip("stage" + "s" * (len(stages) > 1) + " "
                                        + ", ".join(map(str, stages)), _MEM_X - 66), size=10,
                      extra=' fill="#555"')]
        x = float(_MEM_X)
        for i in used:
            width = kinds[i] / scale * _MEM_W
            if width > 0:
                out.append(f'<rect x="{x:.2f}" y="{y + 6:.1f}" width="{width:.2f}" '
                           f'height="{_MEM_ROW - 12}" fill="{_KINDS[i][2]}"><title>GPU {d}: '
                           f"{_KINDS[i][1]} {format_bytes(kinds[i])}</title></rect>")
            x += width
        total = sum(kinds)
        said = format_bytes(total)
        if drawn or total > limit:  # off the scale, the line under the chart says it
            said += (f", {_share(total / limit)} of the limit" if total <= limit else
                     f": over the limit by {format_bytes(total - limit)}")
        if drawn:  # the figures right of the limit's line, not across it
            x = max(x, _MEM_X + limit / scale * _MEM_W)
        out.append(_text(x + 6, middle + 4, said, size=10,
                         extra=f' fill="{_LIMIT}"' if total > limit else ""))
        y += _MEM_ROW
    out += _byte_axis(scale, y)
    if drawn:
        x = _MEM_X + limit / scale * _MEM_W
        out += [f'<line x1="{x:.2f}" y1="{top - 4:.1f}" x2="{x:.2f}" y2="{y:.1f}" '
                f'stroke="{_LIMIT}" stroke-width="2" stroke-dasharray="5 3"/>',
                _text(x, top - 7, f"limit {format_bytes(limit)}", size=10,
                      extra=f' fill="{_LIMIT}" text-anchor="middle"')]
    elif math.isfinite(limit):
        out.append(_text(_MEM_X, y + 40, f"The memory limit, {format_bytes(limit)} per GPU, "
                         f"is off this scale: the fullest GPU holds {_share(fullest / limit)} "
                         "of it.", extra=f' fill="{_LIMIT}"'))
    else:
        out.append(_text(_MEM_X, y + 40, "No memory limit was given."))
    return _svg("memory", y + 50, out)


def _share(fraction: float) -> str:
    """``0.123`` -> "12%"; a share that rounds to none is "under 1%"."""
    return "under 1%" if 0 < fraction < 0.005 else f"{fraction:.0%}"


def _legend(items: list[tuple[str, str]], y: float) -> tuple[list[str], float]:
    """Swatches and names in lines across the drawing; the parts and the next free y."""
    out: list[str] = []
    x = float(_MEM_X)
    for name, colour in items:
        width = 18 + _CHAR * 11 * len(name) + 16
        if x + width > _WIDTH:
            x, y = float(_MEM_X), y + 18
        out += [f'<rect x="{x:.1f}" y="{y:.1f}" width="12" height="12" fill="{colour}"/>',
                _text(x + 17, y + 10, name)]
        x += width
    return out, y + 18


def _byte_axis(scale: float, y: float) -> list[str]:
    """The bytes axis under the bars: ticks at round sizes of one unit, labelled."""
    unit = next((u for u in (2**50, 2**40, 2**30, 2**20, 2**10) if scale >= u), 1)
    span = scale / unit
    power = 10.0 ** math.floor(math.log10(span / 5)) if span >= 5 else 1.0
    step = next(power * f for f in (1, 2, 5, 10) if span / (power * f) <= 6) * unit
    out = [f'<line x1="{_MEM_X}" y1="{y:.1f}" x2="{_MEM_X + _MEM_W}" y2="{y:.1f}" '
           'stroke="#333" stroke-width="0.8"/>']
    for i in range(int(scale / step + 1e-9) + 1):
        x = _MEM_X + i * step / scale * _MEM_W
        out += [f'<line x1="{x:.2f}" y1="{y:.1f}" x2="{x:.2f}" y2="{y + 4:.1f}" '
                'stroke="#333" stroke-width="0.8"/>',
                _text(x, y + 16, format_bytes(i * step) if i else "0", size=9,
                      extra=' text-anchor="middle"')]
    return out


# The baselines' panels: the names' column, then one panel per figure.
_PANEL_X, _PANEL_W, _BASE_ROW = 170, 270, 24


def _baselines_svg(plan: Plan) -> str:
    rows = compared(plan)
    panels = [("bottleneck (per micro-batch)", [e.bottleneck_s for _, e in rows], format_ms),
              ("iteration (a step)", [e.iteration_s for _, e in rows], format_ms),
              ("largest GPU's memory", [float(e.max_memory) for _, e in rows], format_bytes)]
    out = []
    for p, (title, _values, _say) in enumerate(panels):
        out.append(_text(_PANEL_X + p * (_PANEL_W + 10), 14, title, extra=' fill="#666"'))
    for i, (name, estimate) in enumerate(rows):
        y = 24 + i * _BASE_ROW
        colour = "#4c72b0" if i == 0 else "#a5a5a5"
        out.append(_text(8, y + 15, _clip(name, _PANEL_X - 14),
                         extra=(' font-weight="bold"' if i == 0 else "")
                         + ("" if estimate.fits else f' fill="{_LIMIT}"')))
        for p, (_title, values, say) in enumerate(panels):
            left = _PANEL_X + p * (_PANEL_W + 10)
            width = values[i] / (max(values) or 1.0) * (_PANEL_W - 120)
            fill = colour if estimate.fits or p < 2 else _LIMIT  # memory that does not fit
            out += [f'<rect x="{left}" y="{y + 4}" width="{max(width, 1):.2f}" '
                    f'height="{_BASE_ROW - 8}" fill="{fill}"/>',
                    _text(left + max(width, 1) + 5, y + 15, say(values[i]) + (
                        "" if estimate.fits or p < 2 else ", does not fit"), size=10,
                        extra="" if estimate.fits or p < 2 else f' fill="{_LIMIT}"')]
    return _svg("baselines", 30 + len(rows) * _BASE_ROW, out)


def _baselines_table(plan: Plan) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("partition", "bottleneck", "iteration",
                                              "max memory", "fits"))
    rows = [
        "<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row[:4])
        + (f'<td class="no">{row[4]}</td>' if row[4] == "NO" else f"<td>{row[4]}</td>")
        + "</tr>"
        for row in summary_rows(plan)
    ]
    return "\n".join(["<table>", f"<tr>{head}</tr>", *rows, "</table>"])


def _layouts(layout: Layout | None) -> list[str]:
    """The layouts the search considered and those a person would pick by hand (report.md's
    table), where there is more than the chosen one."""
    if layout is None or len(layout.considered) < 2:
        return []
    columns, cells = layout_table(layout)
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    rows = ["<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>"
            for row in cells]
    return ["<h2>Layouts</h2>",
            "<p>Each layout of the GPUs the search considered, the chosen one first; one whose "
            "bound was no better than the chosen step was not planned and shows its bound "
            "alone. Last, the layouts a person would pick by hand, planned as they would "
            "run.</p>",
            "<table>", f"<tr>{head}</tr>", *rows, "</table>"]
