"""report.html: one self-contained page drawing the plan over the model's own layers, the
memory per GPU against the limit, the schedule and the baselines; opened in a real
headless Chromium where one is installed (.ci/run installs Debian's)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from fxpipe.compiler import analyze_file, output_files, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import Traced
from fxpipe.output import write_folder
from fxpipe.passes import annotate_modules
from fxpipe.plan import Estimate, Layout, Plan, SolverReport, StagePlan
from fxpipe.profile import auto_depth
from fxpipe.report import render_html
from fxpipe.report.diagram import PALETTE
from fxpipe.report.layers import cuts, stage_layers
from fxpipe.request import split_options
from fxpipe.units import format_bytes
from tests._cli import fxpipe_process

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "gpt.py")
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Traced, Plan, Path]:
    """examples/gpt.py split as one pipeline on 4 GPUs with 8 micro-batches, as `fxpipe
    split --gpus 4 --pp 4 --microbatches 8` does, written to a folder."""
    out = tmp_path_factory.mktemp("html") / "out"
    h100 = get_device("h100")
    source, traced = analyze_file(GPT, device=h100, solvable=True)
    options = split_options(gpus=4, pp=4, microbatches=8)
    plan = plan_split(traced, label=source.label, options=options)
    write_folder(out, output_files(traced, plan, label=source.label))
    return traced, plan, out


def _page(text: str) -> ET.Element:
    """The page as XML: it is written well-formed, so an unclosed tag fails here."""
    return ET.fromstring(text.removeprefix("<!DOCTYPE html>\n"))


def _svgs(page: ET.Element) -> dict[str, ET.Element]:
    return {svg.get("id", ""): svg for svg in page.iter(f"{SVG}svg")}


def _said(svg: ET.Element) -> str:
    """The words of a drawing."""
    return " ".join("".join(text.itertext()) for text in svg.iter(f"{SVG}text"))


def test_the_page_stands_alone_and_draws_four_charts(gpt: tuple[Traced, Plan, Path]) -> None:
    _, plan, out = gpt
    text = (out / "report.html").read_text(encoding="utf-8")
    # nothing fetched: no script, stylesheet, font or image from anywhere
    for needle in ("<script", "<link", "<img", "src=", "url(", "@import", "@font-face"):
        assert needle not in text, needle
    assert set(re.findall(r"https?://[^\s\"']+", text)) == {"http://www.w3.org/2000/svg"}
    svgs = _svgs(_page(text))
    assert list(svgs) == ["layers", "memory", "schedule", "baselines"]
    for name, svg in svgs.items():
        assert len(list(svg.iter(f"{SVG}rect"))) > plan.num_stages, name
    # report.md points at it
    assert "[report.html](report.html)" in (out / "report.md").read_text(encoding="utf-8")


def test_the_page_shows_the_layouts_considered_and_picked_by_hand(
        gpt: tuple[Traced, Plan, Path]) -> None:
    _, plan, out = gpt
    assert plan.layout is not None
    text = (out / "report.html").read_text(encoding="utf-8")
    page = _page(text)
    heading = [h for h in page.iter("h2") if h.text == "Layouts"]
    assert heading, "no Layouts section"
    table = next(t for t in page.iter("table")
                 if any(th.text == "pipeline stages" for th in t.iter("th")))
    rows = [[td.text for td in tr.iter("td")] for tr in table.iter("tr")][1:]
    assert len(rows) == len(plan.layout.considered)
    assert rows[0][-1] == "chosen" and rows[0][:2] == [str(plan.layout.pp), str(plan.layout.dp)]
    assert {row[-1] for row in rows if row[-1].startswith("by hand")} == {
        "by hand: pure FSDP", "by hand: torchtitan's layer-count cuts"}


def test_the_page_is_the_same_from_a_new_interpreter(gpt: tuple[Traced, Plan, Path],
                                                      tmp_path: Path) -> None:
    _, _, out = gpt
    done = fxpipe_process("split", GPT, "--gpus", "4", "--pp", "4", "--microbatches", "8",
                          "--out", "b", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "b" / "plan.json").read_bytes() == (out / "plan.json").read_bytes()
    assert (tmp_path / "b" / "report.html").read_bytes() == (out / "report.html").read_bytes()


def test_the_layers_are_the_models_modules(gpt: tuple[Traced, Plan, Path]) -> None:
    traced, plan, out = gpt
    said = _said(_svgs(_page((out / "report.html").read_text(encoding="utf-8")))["layers"])
    for module in ("tok_emb", "pos_emb", "ln_f", "lm_head"):
        assert module in said, module
    assert all(f"stage {j}" in said for j in range(plan.num_stages))
    # each cut names the module of the last op before it, and what crosses it
    found = cuts(traced.gm, plan)
    assert [c.after_stage for c in found] == list(range(plan.num_stages - 1))
    for cut in found:
        assert f"cut between {cut.last} and {cut.first}: {format_bytes(cut.nbytes)}" in said
        assert cut.values and cut.nbytes > 0
    # every op of the plan is in one row of its stage
    rows = stage_layers(traced.gm, plan, depth=auto_depth(traced.gm))
    assert [sum(row.ops for row in stage) for stage in rows] == [
        len(stage.nodes) for stage in plan.stages]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.fc1(x).relu())


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.layers = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _cut_plan(gm: torch.fx.GraphModule, last: str) -> Plan:
    """Two stages, the first ending with node ``last``."""
    ops = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    k = ops.index(last) + 1
    estimate = Estimate(bottleneck_s=1.0, iteration_s=1.0, bubble_fraction=0.0,
                        max_memory=0, fits=True)
    return Plan(num_stages=2, schedule="1f1b", microbatches=2,
                stages=(StagePlan(0, tuple(ops[:k])), StagePlan(1, tuple(ops[k:]))),
                solver=SolverReport("hand-written", "HEURISTIC", 1.0, 1.0), estimate=estimate)


def test_whole_layers_are_one_row_and_a_cut_layer_names_its_parts() -> None:
    gm = annotate_modules(torch.fx.symbolic_trace(_Net()))
    plan = _cut_plan(gm, "layers_3_fc1")  # three blocks and a half, then the rest
    first, second = stage_layers(gm, plan, depth=auto_depth(gm))
    assert [(r.name, r.type_name, r.parts, r.count) for r in first] == [
        ("emb", "Linear", (), 1), ("layers.0-2", "_Block", (), 3), ("layers.3", "_Block",
                                                                      ("fc1",), 1)]
    assert [(r.name, r.parts) for r in second] == [("layers.3", ("fc2",)), ("head", ())]
    (cut,) = cuts(gm, plan)
    # the block's input (its residual) and fc1's output cross; relu is the block's own op
    assert (cut.last, cut.first) == ("layers.3.fc1", "layers.3")
    assert [name for name, _, _ in cut.values] == ["add_2", "layers_3_fc1"]


def test_a_plan_of_several_pipelines_says_its_layout() -> None:
    gm = annotate_modules(torch.fx.symbolic_trace(_Net()))
    plan = _cut_plan(gm, "layers_1_fc2")
    assert "layout:" not in render_html(plan, gm, depth=auto_depth(gm))
    layout = Layout(gpus=8, gpus_per_node=4, pp=2, dp=4, dp_mode="fsdp", global_batch=64,
                    microbatch_size=2, microbatches=8, pipeline_link="intra",
                    sync_link="inter", sync_s=1e-3, step_s=2.0, proved=True)
    page = render_html(replace(plan, layout=layout), gm, depth=auto_depth(gm))
    assert ("<li>layout: 8 GPUs (4 per host) as 2 pipeline stages x 4 data-parallel (fsdp)"
            "</li>") in page


def _memory_bars(html: str) -> dict[int, float]:
    """GPU -> the width of its stacked bar in the memory chart."""
    widths: dict[int, float] = {}
    for rect in _svgs(_page(html))["memory"].iter(f"{SVG}rect"):
        title = rect.find(f"{SVG}title")
        if title is not None and title.text:
            gpu = int(title.text.split(":")[0].removeprefix("GPU "))
            widths[gpu] = widths.get(gpu, 0.0) + float(rect.get("width", "0"))
    return widths


def test_memory_bars_measure_each_gpu_against_the_limit(gpt: tuple[Traced, Plan, Path]
                                                         ) -> None:
    traced, plan, _ = gpt
    depth = auto_depth(traced.gm)
    page = render_html(plan, traced.gm, depth=depth)
    widths = _memory_bars(page)
    totals = [stage.memory.total for stage in plan.stages]
    assert sorted(widths) == list(range(plan.num_devices))
    for d in widths:  # the bars are to one scale
        assert widths[d] / max(widths.values()) == pytest.approx(totals[d] / max(totals),
                                                                 rel=1e-3)
    assert "deferred W" not in page and "stashed weights" not in page  # none on 1F1B
    # 80 GiB is off the scale of a few MiB: said, not drawn
    said = _said(_svgs(_page(page))["memory"])
    assert "is off this scale" in said and "limit 80.0 GiB" not in said
    near = render_html(replace(plan, memory_limit=2.0 * max(totals)), traced.gm, depth=depth)
    assert f"limit {format_bytes(2.0 * max(totals))}" in near and "off this scale" not in near
    memory = _svgs(_page(near))["memory"]
    (limit,) = [line for line in memory.iter(f"{SVG}line") if line.get("stroke-dasharray")]
    start = min(float(r.get("x", "0")) for r in memory.iter(f"{SVG}rect")
                if r.find(f"{SVG}title") is not None)
    fullest = max(_memory_bars(near).values())  # half the way to the limit's line
    assert fullest / (float(limit.get("x1", "0")) - start) == pytest.approx(0.5, rel=1e-3)
    over = render_html(replace(plan, memory_limit=0.5 * max(totals)), traced.gm, depth=depth)
    assert "over the limit by" in over


# --- in a real browser ------------------------------------------------------------------

def _chromium() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)


def _open(page: Path, screenshot: Path) -> tuple[str, list[str]]:
    """The DOM headless Chromium builds of ``page`` and its console's messages, with a
    screenshot 1400 x 2000 pixels."""
    browser = _chromium()
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium; .ci/run does)")
    done = subprocess.run(
        [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
         f"--user-data-dir={screenshot.parent / 'profile'}", "--enable-logging=stderr",
         "--v=0", "--window-size=1400,2000", f"--screenshot={screenshot}", "--dump-dom",
         page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


def _colours(png: bytes) -> set[bytes]:
    """The distinct RGB colours of an 8-bit RGB or RGBA PNG (Chromium's screenshots)."""
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    chunks: dict[bytes, list[bytes]] = {}
    at = 8
    while at < len(png):
        length, kind = struct.unpack(">I4s", png[at:at + 8])
        chunks.setdefault(kind, []).append(png[at + 8:at + 8 + length])
        at += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    assert depth == 8 and colour in (2, 6) and not interlace, (depth, colour, interlace)
    step = 3 if colour == 2 else 4
    stride = width * step
    raw = zlib.decompress(b"".join(chunks[b"IDAT"]))
    above, seen = bytearray(stride), set()
    for y in range(height):
        row = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        kind, line = row[0], bytearray(row[1:])
        if kind == 2:  # undo the row's filter (the PNG spec's section 9): up
            line = bytearray((x + b) & 255 for x, b in zip(line, above, strict=True))
        elif kind in (1, 3, 4):  # left; average; Paeth
            for i in range(stride):
                a = line[i - step] if i >= step else 0
                b, c = above[i], above[i - step] if i >= step else 0
                if kind == 1:
                    line[i] = (line[i] + a) & 255
                elif kind == 3:
                    line[i] = (line[i] + (a + b) // 2) & 255
                else:
                    p = a + b - c
                    near = min((abs(p - a), 0, a), (abs(p - b), 1, b), (abs(p - c), 2, c))
                    line[i] = (line[i] + near[2]) & 255
        seen.update(bytes(line[i:i + 3]) for i in range(0, stride, step))
        above = line
    return seen


def test_chromium_opens_the_page_without_errors_and_draws_it(gpt: tuple[Traced, Plan, Path],
                                                            tmp_path: Path) -> None:
    _, plan, out = gpt
    dom, console = _open(out / "report.html", tmp_path / "gpt.png")
    assert console == [], console
    svgs = _svgs(_page(_xml_of(dom)))
    assert list(svgs) == ["layers", "memory", "schedule", "baselines"]
    assert all(len(list(svg.iter(f"{SVG}rect"))) > plan.num_stages for svg in svgs.values())
    seen = _colours((tmp_path / "gpt.png").read_bytes())
    assert len(seen) > 50  # not a blank page
    drawn = {PALETTE[0], PALETTE[1], "#4c72b0", "#dd8452"}  # stages; parameters, activations
    assert {bytes.fromhex(c[1:]) for c in drawn} <= seen


def test_a_console_error_is_caught(tmp_path: Path) -> None:
    """The check above can fail: a page that logs an error is caught."""
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><body><script>console.error("boom")</script>'
                    "</body></html>", encoding="utf-8")
    _, console = _open(page, tmp_path / "bad.png")
    assert len(console) == 1 and "boom" in console[0], console


def _xml_of(dom: str) -> str:
    """Chromium's serialized DOM as XML: its void elements closed."""
    return re.sub(r"<(meta|br|hr)([^>]*?)/?>", r"<\1\2/>", dom)
