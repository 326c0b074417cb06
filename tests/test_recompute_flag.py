"""--recompute: the flag's values, its one-line error, and a real model that fits under a
memory limit only by recomputing on some stages, never on its last (which holds one
micro-batch in 1F1B either way)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fxpipe import cli, meta
from fxpipe.codegen.package import runner_header
from fxpipe.compiler import SplitOptions, plan_split
from fxpipe.cost_models import Device, get_device
from fxpipe.partition import InfeasibleMemoryError, Recompute
from fxpipe.plan import Plan, StageRecompute
from fxpipe.report import render_report

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
NONE, SELECTIVE, FULL = StageRecompute


def test_recompute_values() -> None:
    """The command line's words are the plan's and the runtime's (``full``), and ``all``,
    the word for full before, still reads as full."""
    parser = cli._parser()
    split = ["split", GPT, "--gpus", "2", "--pp", "2"]
    assert parser.parse_args(split).recompute == "auto"  # the default
    assert cli._recompute(parser.parse_args([*split, "--recompute"]).recompute) is (
        Recompute.FULL)  # bare
    for name in ("auto", "full", "selective", "none"):
        value = parser.parse_args([*split, "--recompute", name]).recompute
        assert cli._recompute(value) is Recompute(name)
        assert Recompute(name).value == name
    assert {r.value for r in Recompute} - {"auto"} == {r.value for r in StageRecompute}
    assert cli._recompute("all") is Recompute.FULL is Recompute("all")


def test_bad_recompute_value_is_one_line_error(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["split", GPT, "--gpus", "2", "--pp", "2", "--recompute", "sometimes",
                     "--out", str(tmp_path / "out")])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("fxpipe: error: --recompute takes one of auto, full, "
                               "selective, none")
    assert "'sometimes'" in lines[0] and "(a bare --recompute means full)" in lines[0]
    assert not (tmp_path / "out").exists()


def test_gpt_recomputes_where_it_must_and_the_plan_says_where() -> None:
    _, traced = cli.analyze_model(GPT, device="h100", quiet=True)

    def split(recompute: Recompute, limit: float) -> Plan:
        options = SplitOptions(gpus=4, device=get_device("h100"), memory_limit=limit,
                               microbatches=16, recompute=recompute, time_limit_s=20)
        return plan_split(traced, label="gpt", options=options)

    everywhere = split(Recompute.FULL, float("inf"))
    assert all(stage.recompute is FULL for stage in everywhere.stages)
    limit = float(everywhere.estimate.max_memory)
    with pytest.raises(InfeasibleMemoryError):
        split(Recompute.NONE, limit)
    auto = split(Recompute.AUTO, limit)
    modes = [stage.recompute for stage in auto.stages]
    assert modes[-1] is NONE and any(mode is not NONE for mode in modes)
    assert auto.estimate.fits
    assert auto.estimate.iteration_s < everywhere.estimate.iteration_s
    # plan.json and the report carry the choice
    assert [s.recompute for s in Plan.from_json(auto.to_json()).stages] == modes
    report = render_report(auto)
    for mode, said in ((FULL, "in full"), (SELECTIVE, "selectively")):
        chosen = [str(j) for j, m in enumerate(modes) if m is mode]
        listed = f"stage {chosen[0]}" if len(chosen) == 1 else f"stages {', '.join(chosen)}"
        assert (f"{listed} {said}" in report) == bool(chosen), report


# An H100 on whose host torch's SAC costs nothing: the hand-written GPT's ops take
# microseconds, so on the H100's own row SAC's host time (``Device.sac_dispatch``) makes a
# selective stage slower than one recomputed in full, and the tests of what selective
# keeps plan on this one
NO_SAC_HOST = replace(get_device("h100"), sac_dispatch=0.0)


def test_selective_recompute_keeps_the_matmuls_and_pays_for_the_rest() -> None:
    """Every stage recomputed selectively: the hand-written GPT's matmuls' outputs kept, so
    it needs less memory than keeping everything and more than recomputing everything,
    and pays less time than recomputing everything and more than none, but for SAC's host
    time: every op of both runs takes the host 60 µs on an H100's row, longer than this
    GPT's ops, which makes selective the slowest of the three there."""
    _, traced = cli.analyze_model(GPT, device="h100", quiet=True)

    def plans(device: Device) -> dict[Recompute, Plan]:
        return {policy: plan_split(traced, label="gpt", options=SplitOptions(
            gpus=4, device=device, memory_limit=float("inf"), microbatches=16,
            recompute=policy, time_limit_s=20)) for policy in (Recompute.NONE,
                                                               Recompute.SELECTIVE,
                                                               Recompute.FULL)}

    free = plans(NO_SAC_HOST)
    selective = free[Recompute.SELECTIVE]
    assert all(stage.recompute is SELECTIVE for stage in selective.stages)
    memory = [free[p].estimate.max_memory for p in free]
    time = [free[p].estimate.iteration_s for p in free]
    assert memory[0] > memory[1] > memory[2]
    assert time[0] < time[1] < time[2]
    h100 = plans(get_device("h100"))
    time = [h100[p].estimate.iteration_s for p in h100]
    assert time[0] < time[2] < time[1]


def test_auto_keeps_only_some_matmuls_where_keeping_all_does_not_fit() -> None:
    """Between what recomputing everywhere and selectively keeping everything need, the
    GPT's first stage (16 micro-batches in flight under 1F1B) keeps only its matmuls that
    cost the most to run again per byte (a keep level's rule) rather than none of them (in
    full), and plan.json, the report and the generated runner say by which rule."""
    _, traced = cli.analyze_model(GPT, device="h100", quiet=True)

    def split(recompute: Recompute, limit: float) -> Plan:
        options = SplitOptions(gpus=4, device=NO_SAC_HOST, memory_limit=limit,
                               microbatches=16, recompute=recompute, time_limit_s=20)
        return plan_split(traced, label="gpt", options=options)

    least = float(split(Recompute.FULL, float("inf")).estimate.max_memory)
    kept_all = float(split(Recompute.SELECTIVE, float("inf")).estimate.max_memory)
    auto = split(Recompute.AUTO, least + 0.3 * (kept_all - least))
    ruled = [s for s in auto.stages if s.keeps is not None]
    assert ruled and all(s.recompute is SELECTIVE for s in ruled), auto.stages
    assert auto.estimate.fits and auto.solver.status == "OPTIMAL"
    assert Plan.from_json(auto.to_json()).stages == auto.stages
    stage = ruled[0]
    work, width = stage.keeps
    assert stage.recompute_mode == f"selective:{work}:{width}"
    assert f"only the ones doing more than {work} FLOPs per element" in render_report(auto)
    runner = runner_header(traced, auto)
    assert f'"selective:{work}:{width}"' in runner and '# ("selective:W:N" keeps' in runner


def test_selective_recompute_under_a_schedule_that_splits_the_backward_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["split", GPT, "--gpus", "2", "--pp", "2", "--schedule", "zb1p", "--recompute",
                     "selective", "--out", str(tmp_path / "out")])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "selective recompute cannot: use --recompute full, auto or none" in lines[0]
    assert not (tmp_path / "out").exists()


WRITES_INTO_A_MATMUL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = self.fc1(x).relu()
        h = self.fc2(h)
        h.add_(1)
        return self.fc3(h.tanh())


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(256, 8),)
"""


def test_a_model_that_writes_into_a_matmuls_output_never_keeps_that_output(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SAC would keep the output written: the memory pass sees the write, and no keep level
    keeps it (each rule skips fc2's outputs, 2 x 32 FLOPs per element into 32 columns):
    --recompute selective keeps fc1's and fc3's. Where the model writes into every output
    selective recompute could keep, it is refused in one line that names the op (auto
    then chooses between none and full only: tests/partition/test_evaluate.py)."""
    model = tmp_path / "writes.py"
    model.write_text(WRITES_INTO_A_MATMUL)
    _, traced = cli.analyze_model(str(model), device="h100", quiet=True)
    writers = [n.name for n in traced.gm.graph.nodes
               if (info := meta.BYTES.get(n)) is not None and info.writes_kept]
    assert len(writers) == 1 and "add" in writers[0], writers
    kept = {n.name: meta.BYTES.get(n).selective_bytes for n in traced.gm.graph.nodes
            if meta.BYTES.get(n) is not None}
    assert [name for name, size in kept.items() if size] == ["fc1", "fc2", "fc3"], kept
    code = cli.main(["split", str(model), "--gpus", "2", "--pp", "2", "--recompute", "selective",
                     "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    plan = Plan.from_json((tmp_path / "out" / "plan.json").read_text())
    assert [(s.recompute, s.keeps, s.skips) for s in plan.stages] == [
        (SELECTIVE, None, ((64, 32),))] * 2
    assert plan.stages[0].recompute_mode == "selective:0:0:64x32"
    assert '"selective:0:0:64x32"' in (tmp_path / "out" / "runner.py").read_text()
    assert "none keeps the ones the model writes into in place (64 FLOPs per element into 32 " \
           "columns)" in (tmp_path / "out" / "report.md").read_text()
    every = tmp_path / "every.py"  # into fc1's, fc2's and fc3's outputs
    every.write_text(WRITES_INTO_A_MATMUL.replace(
        "h = self.fc1(x).relu()", "h = self.fc1(x)\n        h.add_(1)\n        h = h.relu()"
    ).replace("return self.fc3(h.tanh())", "return self.fc3(h.tanh()).add_(1)"))
    assert every.read_text().count(".add_(1)") == 3, every.read_text()
    code = cli.main(["split", str(every), "--gpus", "2", "--pp", "2", "--recompute", "selective",
                     "--out", str(tmp_path / "out2")])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "writes in place into the output of a matmul or attention" in lines[0], lines
    assert not (tmp_path / "out2").exists()
