"""fxpipe split's layouts: searched, pinned, written and refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests._cli import fxpipe

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"


def _split(tmp_path: Path, *flags: str) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    ran = fxpipe("split", GPT, "--gpus", "4", *flags, "--out", tmp_path / "out", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    return json.loads((tmp_path / "out" / "plan.json").read_text())


def test_the_search_writes_the_layout_it_chose_and_every_one_it_considered(
        tmp_path: Path) -> None:
    plan = _split(tmp_path, "--pp", "auto")
    layout = plan["layout"]
    assert layout["gpus"] == 4 and layout["pp"] * layout["dp"] == 4
    assert plan["num_stages"] == layout["pp"] and plan["microbatches"] == layout["microbatches"]
    # the global batch stays the default step's: 4 x 4 micro-batches of the example's 2
    assert layout["global_batch"] == 16 * 2 == layout["dp"] * layout["microbatches"] * 2
    considered = {(r["pp"], r["dp_mode"]): r for r in layout["considered"]}
    assert set(considered) == {(1, "fsdp"), (2, "fsdp"), (4, "ddp")}
    chosen = [r for r in layout["considered"] if r["status"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["pp"] == layout["pp"]
    for row in layout["considered"]:  # a layout not planned is bounded at no better a step
        assert row["step_s"] is not None or row["bound_s"] >= layout["step_s"] - 1e-12
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Layout" in report and "| pipeline stages | data-parallel |" in report


def test_a_layouts_pipeline_runs_two_stages_a_gpu_under_interleaved_and_a_v(
        tmp_path: Path) -> None:
    """--pp 2 with --schedule zbv (a V) or interleaved: 4 stages on each pipeline's 2 GPUs,
    placed as the schedule places them (the layout refused them before)."""
    for schedule, flags, placed in [("zbv", (), [0, 1, 1, 0]),
                                    ("interleaved", ("--virtual-stages", "2"), [0, 1, 0, 1])]:
        plan = _split(tmp_path / schedule, "--pp", "2", "--schedule", schedule, *flags)
        assert (plan["layout"]["pp"], plan["layout"]["dp"]) == (2, 2), plan["layout"]
        assert (plan["schedule"], plan["virtual_stages"], plan["num_stages"]) == (
            schedule, 2, 4)
        runner = (tmp_path / schedule / "out" / "runner.py").read_text()
        assert f"DEVICE_OF = {tuple(placed)}" in runner, schedule


def test_fsdp_holds_less_than_ddp_by_the_optimizer_state_it_shards(tmp_path: Path) -> None:
    fsdp = _split(tmp_path / "a", "--pp", "2", "--dp-mode", "fsdp")
    ddp = _split(tmp_path / "b", "--pp", "2", "--dp-mode", "ddp")
    # Adam in float32: its two moments are 2 x the parameters; fsdp over 2 copies holds half
    for stage in fsdp["stages"]:
        assert stage["memory"]["optimizer"] == stage["memory"]["params"]
        assert stage["memory"]["grads"] == stage["memory"]["params"]
    for stage in ddp["stages"]:
        assert stage["memory"]["optimizer"] == 2 * stage["memory"]["params"]
    assert fsdp["layout"]["dp_mode"] == "fsdp" and ddp["layout"]["dp_mode"] == "ddp"


def test_pinned_flags_that_cannot_hold_are_one_line(tmp_path: Path) -> None:
    for flags, says in [
        (("--pp", "3"), "--pp 3 does not divide --gpus 4: use one of 1, 2, 4"),
        (("--pp", "two"), "--pp takes auto or a number, got 'two'"),
        (("--global-batch", "5"), "--global-batch 5 is not a whole number of micro-batches "
                                  "of the example's 2 samples"),
        (("--pp", "2", "--replicate"), "--replicate plans one pipeline on all the GPUs"),
        (("--pp", "2", "--dp-mode", "ddp", "--schedule", "zb1p"),
         "torch's DDP does not average the gradients zb1p's weight pass computes"),
    ]:
        ran = fxpipe("split", GPT, "--gpus", "4", *flags, "--out", tmp_path / "x",
                     cwd=tmp_path)
        assert ran.returncode == 2, (flags, ran.stderr)
        assert says in ran.stderr and ran.stderr.count("\n") == 1, ran.stderr
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("flags", "says"), [
    (("--pp", "3"), "--pp 3 does not divide --gpus 4: use one of 1, 2, 4"),
    (("--tp", "3"), "--tp 3 does not divide --gpus-per-node 4"),
    (("--pp", "4", "--tp", "2"), "--pp 4 x --tp 2 GPUs per pipeline do not divide --gpus 4"),
])
def test_degrees_that_cannot_divide_are_refused_before_tracing(
        tmp_path: Path, flags: tuple[str, ...], says: str) -> None:
    """What the flags alone refuse waits for no trace (seconds on a big model)."""
    ran = fxpipe("split", GPT, "--gpus", "4", *flags, "--out", tmp_path / "x", cwd=tmp_path)
    assert ran.returncode == 2 and says in ran.stderr, ran.stderr
    assert "traced" not in ran.stdout + ran.stderr


def test_micro_batches_beside_a_global_batch_must_agree(tmp_path: Path) -> None:
    """--microbatches 3 beside --global-batch 8 (4 micro-batches of the example's 2) was
    dropped without a word; the count that agrees plans as the global batch alone does."""
    ran = fxpipe("split", GPT, "--gpus", "4", "--microbatches", "3", "--global-batch", "8",
                 "--out", tmp_path / "x", cwd=tmp_path)
    assert ran.returncode == 2 and ran.stderr.count("\n") == 1, ran.stderr
    assert ("--global-batch 8 is 4 micro-batches of the example's 2 samples, not the "
            "--microbatches 3 given: leave out one of them, or use --microbatches 4") in ran.stderr
    alone = _split(tmp_path / "a", "--global-batch", "8")
    both = _split(tmp_path / "b", "--global-batch", "8", "--microbatches", "4")
    assert alone == both


def test_the_api_words_a_refused_degree_in_its_own_keywords() -> None:
    import fxpipe as api

    with pytest.raises(ValueError, match=r"^pp=3 does not divide gpus=4: use one of 1, 2, 4$"):
        api.split_file(GPT, gpus=4, pp=3)


def test_the_micro_batch_cap_counts_each_pipelines_share_of_the_step(tmp_path: Path) -> None:
    """1,024 micro-batches a pipeline at most (runner.py lists every action): one pipeline
    is refused 1,200 of them, a layout of 4 pipelines runs 300 each; a step that leaves more
    than 1,024 to every layout's pipelines is one line."""
    ran = fxpipe("split", GPT, "--gpus", "4", "--pp", "4", "--microbatches", "1200", "--out",
                 tmp_path / "x", cwd=tmp_path)
    assert ran.returncode == 2 and "more than 1024" in ran.stderr, ran.stderr
    plan = _split(tmp_path / "layout", "--pp", "1", "--microbatches", "1200")
    assert (plan["layout"]["dp"], plan["microbatches"]) == (4, 300)
    ran = fxpipe("split", GPT, "--gpus", "4", "--pp", "auto", "--global-batch", str(2 * 4100),
                 "--out", tmp_path / "y", cwd=tmp_path)
    assert ran.returncode == 2 and ran.stderr.count("\n") == 1, ran.stderr
    assert ("the step's 4100 micro-batches leave at least 1025 to each pipeline, more than "
            "1024") in ran.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_without_the_cluster_flags_the_search_chooses_the_layout(tmp_path: Path) -> None:
    """--gpus alone is the whole machine: every pipeline degree dividing it is considered;
    --pp equal to --gpus is one pipeline on all of them."""
    plan = _split(tmp_path / "searched")
    layout = plan["layout"]
    assert sorted(row["pp"] for row in layout["considered"]) == [1, 2, 4]
    assert plan["num_stages"] == layout["pp"] and layout["pp"] * layout["dp"] == 4
    one = _split(tmp_path / "one", "--pp", "4")
    assert (one["num_stages"], one["layout"]["dp"]) == (4, 1)


def test_the_layouts_picked_by_hand_are_planned_as_they_run(tmp_path: Path) -> None:
    """Beside the chosen layout, plan.json and the report give the ones a person would pick:
    its degrees with torchtitan's layer-count cuts (the pipeline's uniform-layers baseline
    plus the same sync) and pure FSDP, priced as the search prices its own (with --pp
    pinned too, where pure FSDP was never a candidate)."""
    pinned = _split(tmp_path / "pinned", "--pp", "4")
    rows = {row["why"]: row for row in pinned["layout"]["considered"]
            if row["status"] == "by hand"}
    assert set(rows) == {"torchtitan's layer-count cuts", "pure FSDP"}
    uniform = pinned["baselines"]["uniform-layers"]
    layer_count = rows["torchtitan's layer-count cuts"]
    assert (layer_count["pp"], layer_count["dp"]) == (4, 1)
    assert layer_count["step_s"] == pytest.approx(
        uniform["iteration_s"] + pinned["layout"]["sync_s"])
    assert layer_count["max_memory"] == uniform["max_memory"]
    assert layer_count["step_s"] > pinned["layout"]["step_s"]  # fxpipe's cuts beat it here
    searched = _split(tmp_path / "searched")
    pure = [row for row in searched["layout"]["considered"]
            if (row["pp"], row["dp_mode"]) == (1, "fsdp") and row["status"] != "by hand"]
    assert pure and pure[0]["status"] == "chosen"  # what the search found for pp 1
    assert rows["pure FSDP"]["step_s"] == pytest.approx(pure[0]["step_s"])
    assert rows["pure FSDP"]["max_memory"] == pure[0]["max_memory"]
    # the chosen layout is pure FSDP: nothing else to pick by hand
    assert not [row for row in searched["layout"]["considered"] if row["status"] == "by hand"]
    report = (tmp_path / "pinned" / "out" / "report.md").read_text()
    assert "by hand: torchtitan's layer-count cuts |" in report
    assert "by hand: pure FSDP |" in report


def test_the_command_prints_every_layout_it_considered(tmp_path: Path) -> None:
    """The output's first table is the layouts, the chosen one first, with the sentence
    report.md opens with; a one-stage plan has no cut to put beside the baselines."""
    ran = fxpipe("split", GPT, "--gpus", "4", "--out", tmp_path / "out", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    layout = plan["layout"]
    lines = ran.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if "layout: 4 GPUs (4 per host) as" in line)
    rows = [line for line in lines[title:] if line.startswith("│")]
    assert len(rows) >= len(layout["considered"])
    chosen = rows[0].split("│")
    assert [cell.strip() for cell in chosen[1:4]] == [
        str(layout["pp"]), str(layout["dp"]), layout["dp_mode"]]
    assert "chosen" in rows[0]
    if plan["num_stages"] == 1:
        assert "the whole model on each GPU, nothing to cut" in ran.stdout


def test_when_no_layout_fits_the_leanest_is_named_with_what_it_needs(tmp_path: Path) -> None:
    ran = fxpipe("split", GPT, "--gpus", "4", "--pp", "auto", "--memory", "3MiB", "--out",
                 tmp_path / "x", cwd=tmp_path)
    assert ran.returncode == 2
    line = ran.stderr.strip().splitlines()[-1]
    assert line.startswith("fxpipe: error: no layout of 4 GPUs (4 per host) fits in 3.0 MiB "
                           "per GPU; the leanest, 4 pipeline stages x 1 data-parallel (ddp), "
                           "needs "), line
    # and what would fit: a layout on more GPUs (the next test's), more memory
    assert re.search(r"; it fits on \d+ GPUs as .*; use --gpus \d+ --pp .*, --memory [\d.]+MiB",
                     line), line
    assert not (tmp_path / "x").exists()


def test_when_no_layout_fits_the_fewest_gpus_a_layout_fits_on_are_named(
        tmp_path: Path) -> None:
    """On 2 GPUs of 5 MiB nothing fits; the line names the fewest GPUs, in whole hosts, a
    layout fits on and the flags that plan it, which do (and one host fewer does not)."""
    flags = ["--pp", "auto", "--memory", "5MiB"]
    ran = fxpipe("split", GPT, "--gpus", "2", *flags, "--out", tmp_path / "x", cwd=tmp_path)
    assert ran.returncode == 2 and not (tmp_path / "x").exists()
    line = ran.stderr.strip().splitlines()[-1]
    named = re.search(r"; it fits on (\d+) GPUs as (\d+) pipeline stages x (\d+) "
                      r"data-parallel \((\w+)\); use (--gpus \d+ --pp \d+[^,]*), --memory ",
                      line)
    assert named is not None, line
    gpus, pp, dp = (int(named[i]) for i in (1, 2, 3))
    assert gpus > 2 and pp * dp == gpus
    fix = named[5].split()
    assert fix[-2:] == ["--global-batch", "16"]  # the step's, as --gpus 2 made it
    ran = fxpipe("split", GPT, *fix, "--memory", "5MiB", "--out", tmp_path / "fixed",
                 cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    plan = json.loads((tmp_path / "fixed" / "plan.json").read_text())
    assert (plan["layout"]["pp"], plan["layout"]["dp"]) == (pp, dp)
    fewer = fxpipe("split", GPT, "--gpus", str(gpus - 8 if gpus > 8 else gpus - 1),
                   "--global-batch", "16", *flags, "--out", tmp_path / "y", cwd=tmp_path)
    assert fewer.returncode == 2 and "no layout of" in fewer.stderr


def test_fewer_gpus_than_a_host_holds_are_part_of_one_host(tmp_path: Path) -> None:
    """--gpus 4 --gpus-per-node 8: four GPUs of one host, planned (the check that --gpus
    fill whole hosts refused it for a while)."""
    plan = _split(tmp_path, "--gpus-per-node", "8")
    assert (plan["layout"]["gpus"], plan["layout"]["gpus_per_node"]) == (4, 8)


def test_the_runner_says_it_runs_one_pipeline_of_a_layout(tmp_path: Path) -> None:
    """runner.py runs one pipeline on one host: where the layout has more, it says so and
    what runs them all, rather than pass for the plan's whole step."""
    plan = _split(tmp_path / "two", "--pp", "2")
    runner = (tmp_path / "two" / "out" / "runner.py").read_text()
    assert (f"This runs one pipeline of the plan's layout of {plan['layout']['dp']} "
            f"({plan['layout']['dp_mode']});\ntrain_torchrun.py runs the whole layout") in runner
    _split(tmp_path / "one", "--pp", "4")
    assert "layout" not in (tmp_path / "one" / "out" / "runner.py").read_text().split('"""')[1]


def test_pipedream_runs_as_one_pipeline_on_all_the_gpus(tmp_path: Path) -> None:
    """PipeDream's weight stashing runs in runner.py's one process only: the search laid
    it out as 1 stage x 4 FSDP copies, which nothing could run; it is one pipeline of all
    the GPUs, and a layout pinned with it is one line."""
    mlp = ROOT / "examples" / "mlp.py"  # untied: PipeDream keeps a tied weight's readers together
    ran = fxpipe("split", mlp, "--gpus", "4", "--schedule", "pipedream", "--out",
                 tmp_path / "one", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    plan = json.loads((tmp_path / "one" / "plan.json").read_text())
    assert (plan["layout"]["pp"], plan["layout"]["dp"], plan["num_stages"]) == (4, 1, 4)
    ran = fxpipe("split", mlp, "--gpus", "4", "--schedule", "pipedream", "--pp", "2",
                 "--out", tmp_path / "x", cwd=tmp_path)
    assert ran.returncode == 2 and ran.stderr.count("\n") == 1, ran.stderr
    assert ("--schedule pipedream runs in one process (runner.py), as one pipeline on all the "
            "GPUs: leave out --pp and --tp with it, or use another --schedule (1f1b) for a "
            "layout") in ran.stderr
