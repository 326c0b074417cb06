"""fxpipe split --tp: tensor parallelism inside a host as the layout's third dimension,
searched, pinned, written (plan.json, report.md), refused in one line, and a package of
such a plan running under torchrun only."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from fxpipe.runtime.loading import load_package
from tests._cli import fxpipe

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
LLAMA = ROOT / "examples" / "llama.py"


def _split(tmp_path: Path, *flags: str, model: Path = GPT) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    ran = fxpipe("split", model, "--gpus", "4", *flags, "--out", tmp_path / "out",
                 cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    return json.loads((tmp_path / "out" / "plan.json").read_text())


def test_the_search_takes_the_tp_degree_that_fits_where_one_gpu_a_stage_does_not(
        tmp_path: Path) -> None:
    # the GPT whole on one GPU holds 16.0 MiB; split over 2 GPUs, 9.8 MiB
    plan = _split(tmp_path, "--pp", "1", "--tp", "auto", "--memory", "12MiB")
    layout = plan["layout"]
    assert (layout["pp"], layout["dp"], layout["tp"]) == (1, 2, 2)
    assert layout["mesh"] == ["dp", "pp", "tp"]
    rows = {row.get("tp", 1): row for row in layout["considered"]  # 1: left out
            if row["status"] != "by hand"}
    assert set(rows) == {1, 2, 4} and rows[1]["status"] == "no fit"
    assert rows[2]["status"] == "chosen" and rows[2]["max_memory"] <= 12 * 2**20
    assert layout["tp_pairs"] == 8 and "blocks.*.ln_1" in layout["tp_replicated"]
    assert layout["tp_vocab"] == ["tok_emb", "lm_head"]
    # the residual adds and norms after the first attention, on half the tokens each
    assert layout["sp_ops"] == 16 and layout["sp_kept"] == []
    report = (tmp_path / "out" / "report.md").read_text()
    assert "on 1/2 of the tokens on each GPU (sequence parallelism): 16 ops" in report
    assert "| pipeline stages | data-parallel | tensor-parallel |" in report
    assert "x 2 tensor-parallel: " in report and "rank = (pipeline x 1 + stage) x 2" in report
    assert "tok_emb, lm_head by vocabulary rows" in report


def test_tp_pinned_divides_each_stage_and_its_memory(tmp_path: Path) -> None:
    whole = _split(tmp_path / "a", "--pp", "2", "--tp", "1")
    split = _split(tmp_path / "b", "--pp", "2", "--tp", "2")
    assert {row["tp"] for row in split["layout"]["considered"]
            if row["status"] != "by hand"} == {2}
    assert split["layout"]["dp"] == 1 and whole["layout"]["dp"] == 2
    for one, two in zip(whole["stages"], split["stages"], strict=True):
        # the pairs and the vocabulary halve; norms and the position embedding stay whole
        assert one["memory"]["params"] / 2 < two["memory"]["params"] < one["memory"]["params"]


def test_without_tp_the_plan_is_as_before_it(tmp_path: Path) -> None:
    _split(tmp_path / "a", "--pp", "2")
    _split(tmp_path / "b", "--pp", "2", "--tp", "1")
    before, pinned = ((tmp_path / d / "out" / "plan.json").read_text() for d in "ab")
    assert before == pinned
    layout = json.loads(before)["layout"]
    assert not {"tp", "tp_pairs", "tp_replicated", "tp_vocab", "sp_ops", "sp_kept"} & set(
        layout)
    assert all("tp" not in row for row in layout["considered"])
    assert "tensor-parallel" not in (tmp_path / "a" / "out" / "report.md").read_text()


@pytest.mark.parametrize(("model", "flags", "says"), [
    (GPT, ("--tp", "3"), "--tp 3 does not divide --gpus-per-node 4 (a stage's GPUs share a "
                         "host): use one of 1, 2, 4"),
    (GPT, ("--tp", "two"), "--tp takes auto or a number, got 'two'"),
    (GPT, ("--tp", "0"), "--tp must be auto or at least 1, got 0"),
    (LLAMA, ("--tp", "4"), "--tp 4 does not divide the 2 KV heads of layers.0.attn (4 query "
                           "heads): use one of 1, 2"),
    (LLAMA, ("--tp", "2", "--pp", "4"), "--pp 4 x --tp 2 GPUs per pipeline do not divide "
                                        "--gpus 4"),
])
def test_a_tp_that_cannot_hold_is_one_line(tmp_path: Path, model: Path, flags: tuple[str, ...],
                                           says: str) -> None:
    ran = fxpipe("split", model, "--gpus", "4", *flags, "--out", tmp_path / "x", cwd=tmp_path)
    assert ran.returncode == 2, ran.stderr
    assert says in ran.stderr and ran.stderr.count("\n") == 1, ran.stderr
    assert not (tmp_path / "x").exists()


def test_a_package_of_a_tp_plan_runs_under_torchrun_only(tmp_path: Path) -> None:
    """The one-process runner refuses in one line; distributed.py runs it, with the table
    of which parameters split along which dim (tests/distributed/test_tensor_parallel_*
    runs it)."""
    _split(tmp_path, "--pp", "2", "--tp", "2")
    package = load_package(tmp_path / "out")
    runner = importlib.import_module(f"{package.__name__}.runner")
    says = ("this plan splits each stage over 2 GPUs (tensor parallelism, --tp 2), which "
            "runs under torchrun only (train_torchrun.py, 4 processes); split again with "
            "--tp 1 to run it in one process")
    with pytest.raises(ValueError, match=r"^this plan splits each stage over 2 GPUs") as error:
        runner.PipelineRunner([])  # before it reads its stages
    assert str(error.value) == says
    distributed = (tmp_path / "out" / "distributed.py").read_text()
    assert "UNSUPPORTED = None" in distributed
    assert "TENSOR_PARALLEL = (2, (" in distributed
    assert "    tensor_parallel=TENSOR_PARALLEL,\n" in distributed


def test_python_plans_and_refuses_tp_as_the_command_line_does() -> None:
    import fxpipe

    with pytest.raises(ValueError, match=r"^tp takes auto or a number, got 'x'$"):
        fxpipe.split_file(GPT, gpus=4, tp="x")
    plan = fxpipe.split_file(GPT, gpus=4, pp=2, tp=2)
    assert plan.layout is not None and (plan.layout.pp, plan.layout.tp) == (2, 2)


def test_when_nothing_fits_the_leanest_layout_names_its_tp_degree(tmp_path: Path) -> None:
    ran = fxpipe("split", GPT, "--gpus", "4", "--tp", "2", "--memory", "3MiB", "--out",
                 tmp_path / "x", cwd=tmp_path)
    assert ran.returncode == 2
    line = ran.stderr.strip().splitlines()[-1]
    assert line.startswith("fxpipe: error: no layout of 4 GPUs (4 per host) fits in 3.0 MiB "
                           "per GPU; the leanest, 2 pipeline stages x 1 data-parallel (ddp) x "
                           "2 tensor-parallel, needs "), line
    assert not (tmp_path / "x").exists()
