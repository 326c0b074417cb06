"""`fxpipe split` end to end through the real command (one run in a new interpreter, the
rest in this one: `tests/_cli.py`): outputs, errors, atomic writing."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests._cli import fxpipe, fxpipe_process

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")


@pytest.fixture(scope="module")
def gpt_split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("split")
    # a new interpreter, as a user runs it; the other tests run the command in this one
    done = fxpipe_process("split", GPT, "--gpus", "4", "--pp", "4", "--microbatches", "8",
                          "--out", "out", cwd=work)
    assert done.returncode == 0, done.stderr
    return work / "out"


def test_split_writes_plan_report_and_diagram(gpt_split: Path) -> None:
    plan = json.loads((gpt_split / "plan.json").read_text())
    assert plan["num_stages"] == 4 and plan["microbatches"] == 8
    assert plan["solver"]["status"] == "OPTIMAL"
    assert plan["solver"]["gap"] <= 0.01
    # Every op sits on exactly one stage and every stage is used.
    names = [n for stage in plan["stages"] for n in stage["nodes"]]
    assert len(names) == len(set(names))
    assert all(stage["nodes"] for stage in plan["stages"])
    # The ILP is never worse than a baseline, under the same cost model.
    for name, baseline in plan["baselines"].items():
        assert plan["estimate"]["bottleneck_s"] <= baseline["bottleneck_s"] * (1 + 1e-9), name
    # The tied embedding / LM head weight is declared: a copy on each stage that reads it.
    holders = [s["index"] for s in plan["stages"] if "tok_emb.weight" in s["parameters"]]
    assert plan["tied"] == {"tok_emb.weight": "copied" if len(holders) > 1 else "colocated"}
    report = (gpt_split / "report.md").read_text()
    assert "## Stages" in report and "uniform-layers" in report
    assert f"- `tok_emb.weight`: {plan['tied']['tok_emb.weight']}\n" in report
    # The stages take any batch and sequence length (up to the model's 64 positions): the
    # plan and the report name those dims and the range assumed.
    dims = {(d["input"], d["dim"]): (d["traced"], d["low"], d["high"])
            for d in plan["dynamic_dims"]}
    assert dims == {("idx", 0): (2, 1, None), ("idx", 1): (64, 1, 64)}
    assert ("- input shapes: dynamic idx[0] (traced 2, at least 1), idx[1] (traced 64, 1 to "
            "64); every other dimension fixed at its traced size") in report
    dot = (gpt_split / "partition.dot").read_text()
    assert all(f"cluster_stage{k}" in dot for k in range(4))
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed: partition.svg is not drawn (CI has it)")
    assert (gpt_split / "partition.svg").read_bytes().lstrip().startswith(b"<?xml")


def test_plan_json_round_trips(gpt_split: Path) -> None:
    from fxpipe.plan import Plan

    text = (gpt_split / "plan.json").read_text()
    assert Plan.from_json(text).to_json() == text
    # the GPT's stages each hold a backward transient (its largest op's gradients) ...
    plan = json.loads(text)
    assert all(stage["memory"]["backward"] > 0 for stage in plan["stages"])
    # ... and a plan.json written before that kind existed still loads, with none
    for stage in plan["stages"]:
        stage["memory"]["total"] -= stage["memory"].pop("backward")
    older = Plan.from_dict(plan)
    assert all(stage.memory.backward == 0 for stage in older.stages)
    assert [s.memory.total for s in older.stages] == [s["memory"]["total"]
                                                      for s in plan["stages"]]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--gpus", "4", "--memory", "2MiB"], "; use --memory"),
        (["--gpus", "500"], "does not fill hosts of 8 GPUs"),
        (["--gpus", "2", "--memory", "lots"], "lots"),
        (["--gpus", "2", "--device", "h900"], "known devices"),
        (["--gpus", "0"], "--gpus must be at least 1"),
    ],
)
def test_split_errors_are_one_line_with_exit_2(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    done = fxpipe("split", MLP if "500" in args else GPT, *args, "--out", "out", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("fxpipe: error:") and expected in lines[-1], done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_infeasible_memory_names_the_memory_that_would_fit(tmp_path: Path) -> None:
    done = fxpipe("split", GPT, "--gpus", "2", "--pp", "2", "--memory", "1MiB", "--out", "out",
                  cwd=tmp_path)
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    needed = message.split("; use --memory ")[1].split()[0].rstrip(",")  # maybe the only fix
    # The memory the message names really is enough.
    again = fxpipe("split", GPT, "--gpus", "2", "--pp", "2", "--memory", needed, "--out", "out",
                   cwd=tmp_path)
    assert again.returncode == 0, again.stderr


def test_a_model_file_finds_the_modules_beside_it(tmp_path: Path) -> None:
    """As ``python net.py`` would, a model file imports the modules of its folder, at its
    top and inside build_model, wherever fxpipe runs from; the folder goes after the
    installed packages, so a module there named like one of them shadows nothing."""
    models, elsewhere = tmp_path / "models", tmp_path / "elsewhere"
    models.mkdir()
    elsewhere.mkdir()
    (models / "fxpipe_beside_layers.py").write_text(
        "from torch import nn\n\n\n"
        "class Block(nn.Sequential):\n"
        "    def __init__(self, width):\n"
        "        super().__init__(nn.Linear(width, width), nn.ReLU())\n")
    (models / "fxpipe_beside_sizes.py").write_text("WIDTH = 16\n")
    (models / "net.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from fxpipe_beside_layers import Block\n\n\n"
        "def build_model():\n"
        "    from fxpipe_beside_sizes import WIDTH\n"
        "    return nn.Sequential(*(Block(WIDTH) for _ in range(4)))\n\n\n"
        "def example_inputs():\n"
        "    return (torch.randn(8, 16),)\n")
    done = fxpipe("split", models / "net.py", "--gpus", "2", "--pp", "2", "--out", "out",
                  cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert json.loads((elsewhere / "out" / "plan.json").read_text())["num_stages"] == 2
    assert sys.path.index(str(models.resolve())) > sys.path.index(os.path.dirname(torch.__file__)
                                                                   .rsplit(os.sep, 1)[0])


def test_existing_foreign_folder_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    done = fxpipe("split", MLP, "--gpus", "2", "--pp", "2", "--out", "out", cwd=tmp_path)
    assert done.returncode == 2 and "--force" in done.stderr
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"
    forced = fxpipe("split", MLP, "--gpus", "2", "--pp", "2", "--out", "out", "--force",
                    cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert not (tmp_path / "out" / "mine.txt").exists()
    assert (tmp_path / "out" / "plan.json").exists()
    # A folder fxpipe wrote is replaced without --force.
    again = fxpipe("split", MLP, "--gpus", "3", "--pp", "3", "--out", "out", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["num_stages"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folders left behind


def test_main_leaves_the_garbage_collector_of_its_caller_as_it_was(tmp_path: Path) -> None:
    """Only the console script (``cli.run``), whose process is fxpipe's alone, retunes the
    collector and freezes what each step built; ``main`` called from a program (as here)
    leaves both as they were."""
    before = (gc.get_threshold(), gc.get_freeze_count())
    done = fxpipe("split", MLP, "--gpus", "2", "--pp", "2", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_solver_errors_are_worded_with_the_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The solver says "allow the solver more work"; the command names the flag that does,
    --work-limit for the deterministic limit, --time-limit for the wall-clock safety net."""
    from fxpipe import cli, compiler
    from fxpipe.partition import NoSolutionError

    def out_of_work(problem: object, *, work_limit: float, time_limit_s: float,
                    replicate: bool, advise: bool = True, quick: bool = False,
                    **_: object) -> None:
        limit = None if replicate else 2**30
        raise NoSolutionError(devices=2, work_limit=work_limit, time_limit_s=time_limit_s,
                              wall_clock=time_limit_s < 1, limit=limit,
                              leanest=1.5 * 2**30 if work_limit in (7, 8) else None,
                              too_big=300_000 if work_limit == 8 else None)

    monkeypatch.setattr(compiler, "partition", out_of_work)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["split", MLP, "--gpus", "2", "--pp", "2", "--time-limit", "0.5"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "fxpipe: error: no split that fits in 1.0 GiB per GPU was found in 0.5 s; raise "
        "--time-limit or the memory limit")
    assert cli.main(["split", MLP, "--gpus", "2", "--replicate", "--work-limit", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "fxpipe: error: no split onto 2 GPUs was found within --work-limit 3; raise "
        "--work-limit")
    # where the search found the leanest split, the memory it surely fits in
    assert cli.main(["split", MLP, "--gpus", "2", "--pp", "2", "--work-limit", "7"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "fxpipe: error: no split that fits in 1.0 GiB per GPU was found within --work-limit "
        "7; the leanest found needs 1.5 GiB: raise --work-limit or use --memory 1.5GiB")
    # where the program was too big for CP-SAT, more work is no fix
    assert cli.main(["split", MLP, "--gpus", "2", "--work-limit", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "fxpipe: error: no split that fits in 1.0 GiB per GPU was found by the interval DP "
        "(too big for CP-SAT: 300,000 placements); the leanest found needs 1.5 GiB: use "
        "more --gpus or use --memory 1.5GiB")
    assert not (tmp_path / "fxpipe-out").exists()


def test_no_fit_on_any_gpu_count_searched_does_not_advise_more_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fxpipe import advice, cli, compiler
    from fxpipe.partition import InfeasibleMemoryError

    def nothing_fits(problem: object, **_: object) -> None:
        raise InfeasibleMemoryError(devices=2, limit=2**30, needed=3 * 2**30, searched=64)

    monkeypatch.setattr(compiler, "partition", nothing_fits)
    # the failure is made up: at any micro-batch size the model fits really
    monkeypatch.setattr(advice, "fitting_samples", lambda *_, **__: None)
    monkeypatch.chdir(tmp_path)
    # bf16-true: no leaner precision to try either
    # --replicate: one pipeline on both GPUs, whose error this is (a layout has its own)
    assert cli.main(["split", MLP, "--gpus", "2", "--replicate", "--precision", "bf16-true"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "fxpipe: error: no split of the model onto 2 GPUs fits in 1.0 GiB per GPU; the best "
        "split needs 3.0 GiB, and none was found on up to 64 GPUs; use --memory 3.0GiB")


@pytest.mark.parametrize("command", ["split", "profile"])
def test_bad_precision_is_one_line_naming_the_valid_ones(command: str, tmp_path: Path) -> None:
    extra = ["--gpus", "2"] if command == "split" else []
    result = fxpipe(command, MLP, *extra, "--precision", "fp8", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "32-true, bf16-mixed, bf16-true, 16-mixed" in result.stderr
    assert not (tmp_path / "fxpipe-out").exists()


def test_precision_is_recorded_in_plan_and_report(tmp_path: Path) -> None:
    result = fxpipe("split", MLP, "--gpus", "2", "--precision", "bf16-mixed", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "fxpipe-out"
    assert json.loads((out / "plan.json").read_text())["precision"] == "bf16-mixed"
    assert "precision bf16-mixed" in (out / "report.md").read_text()


def test_a_drawing_graphviz_fails_on_leaves_the_plan_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dot failing on the partition diagram (its "trouble in init_rank" on some clustered
    graphs) is not the plan's failure: the split succeeds, without partition.svg, and
    says why in one note; the report does not point at a missing file."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dot").write_text("#!/bin/sh\necho 'trouble in init_rank' >&2\nexit 1\n")
    (fake / "dot").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    done = fxpipe("split", MLP, "--gpus", "2", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert ("note: Graphviz's dot could not draw partition.svg (trouble in init_rank); "
            "partition.dot holds the diagram") in done.stdout
    assert "not installed" not in done.stdout
    out = tmp_path / "out"
    assert (out / "plan.json").exists() and (out / "partition.dot").exists()
    assert not (out / "partition.svg").exists()
    assert "The partition diagram is `partition.svg`" not in (out / "report.md").read_text()


@pytest.mark.parametrize("words", [["--recompute", "net.py"], ["--recompute", "net.py:make"],
                                   ["--recomp", "net.py"]])
def test_a_bare_recompute_before_the_model_leaves_the_model_its_path(words: list[str]) -> None:
    """argparse gives a flag whose value may be left out the next word, the model's path
    too: it goes back to the model, and the flag means what it means bare."""
    from fxpipe import cli, cli_flags

    args, extra = cli_flags.parse(cli._parser(), ["split", *words, "--gpus", "2"])
    assert (args.model, args.recompute, extra) == (words[1], "full", [])
    # a value that is no model's path is still the flag's (and a one-line error later)
    args, _ = cli_flags.parse(cli._parser(), ["split", "--recompute", "some", "net.py",
                                              "--gpus", "2"])
    assert (args.model, args.recompute) == ("net.py", "some")


def test_split_with_a_bare_recompute_first_recomputes_every_stage(tmp_path: Path) -> None:
    done = fxpipe("split", "--recompute", MLP, "--gpus", "2", "--pp", "2", "--out", "out",
                  cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert [stage["recompute"] for stage in plan["stages"]] == ["full", "full"]


def test_too_many_default_micro_batches_say_where_they_came_from(tmp_path: Path) -> None:
    """--gpus alone sets the micro-batches (4 x --gpus): the error names --gpus and the
    default, not a --microbatches the user never wrote, and docs/errors.md's table has the line."""
    done = fxpipe("split", MLP, "--gpus", "1000", "--pp", "1000", "--out", "out", cwd=tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    message = line.removeprefix("fxpipe: error: ")
    assert message.startswith("--gpus 1000 means 4000 micro-batches (the default, 4 x --gpus)")
    assert "use --microbatches 1024 or fewer" in message
    errors = (ROOT / "docs" / "errors.md").read_text()
    assert (f"| --gpus so many that the default micro-batches are too many | `{message}` |"
            in errors)
    assert not (tmp_path / "out").exists()
