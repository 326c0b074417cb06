"""A CP-SAT search runs in a child process: OR-Tools 9.15 aborts the process on this
stage program (Llama-3-70B's exact groups at 8192 tokens, ``--gpus 64 --pp 8 --tp 8``,
exported by ``CpModel.export_to_file`` as fxpipe searched it: "Check failed:
heuristics.fixed_search != nullptr"), and a search that hangs is killed after its wall
clock. Either way fxpipe lives on with an UNKNOWN search and a warning saying how it
ended; a search that answers is read back whole."""

from __future__ import annotations

import gzip
import os
import time
from pathlib import Path

import ortools
import pytest
from ortools.sat.python import cp_model

from fxpipe.partition import ilp_search
from fxpipe.partition.ilp_search import run_search

MODEL = Path(__file__).resolve().parent / "data" / "fixed_search_abort.pbtxt.gz"

pytestmark = pytest.mark.skipif(os.uname().sysname != "Linux",
                                reason="searches run in a child process on Linux only")


def test_a_search_that_aborts_or_tools_leaves_fxpipe_running() -> None:
    model = cp_model.CpModel()
    with gzip.open(MODEL, "rt") as file:
        model.proto.parse_text_format(file.read())
    assert len(model.proto.variables) > 1000 and model.proto.solution_hint.vars
    with pytest.warns(RuntimeWarning) as caught:
        search = run_search(model, work_limit=7.5, time_limit_s=120, workers=2, log=False)
    if ortools.__version__ == "9.15.6755":  # the version that aborts on it
        assert search.status == "UNKNOWN" and not search.found
        message = str(caught[0].message)
        assert "the CP-SAT search ended on SIGABRT, without an answer (OR-Tools 9.15" in message


@pytest.mark.parametrize("apart", [True, False])
def test_a_search_that_answers_is_read_back_whole(monkeypatch: pytest.MonkeyPatch,
                                                  apart: bool) -> None:
    """From a child, or in this process where the program is too small to pay for one."""
    def no_child(*_: object, **__: object) -> None:
        raise AssertionError("a child for a program of 4 variables")

    if apart:
        monkeypatch.setattr(ilp_search, "ISOLATE_FROM", 0)
    else:
        monkeypatch.setattr(ilp_search, "isolated", no_child)
    model = cp_model.CpModel()
    x = [model.new_int_var(0, 9, f"x{i}") for i in range(3)]
    pick = model.new_bool_var("pick")
    model.add(sum(x) >= 7)
    model.add(x[0] >= 4).only_enforce_if(pick)
    model.minimize(3 * x[0] + 2 * x[1] + x[2] + 5 * pick)
    search = run_search(model, work_limit=5, time_limit_s=30, workers=2, log=False)
    assert (search.status, search.objective, search.bound) == ("OPTIMAL", 7.0, 7.0)
    assert [search.value(v) for v in x] + [search.value(pick), search.value(4)] == [
        0, 0, 7, 0, 4]


def test_a_search_that_hangs_is_killed_after_its_wall_clock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def hang(*_: object, **__: object) -> None:
        time.sleep(60)

    monkeypatch.setattr(ilp_search, "_search", hang)  # the child forks with it
    monkeypatch.setattr(ilp_search, "_GRACE_S", 0.5)
    monkeypatch.setattr(ilp_search, "ISOLATE_FROM", 0)
    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="outlived its wall-clock limit and was killed"):
        search = run_search(cp_model.CpModel(), work_limit=1, time_limit_s=0.5, workers=1,
                            log=False)
    assert time.perf_counter() - start < 10
    assert search.status == "UNKNOWN" and search.wall_clock_stopped


def test_the_command_line_shows_fxpipes_own_warnings_as_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As its errors: ``fxpipe: warning:`` and the message on one line; a warning from
    elsewhere (torch, a model) keeps Python's form, which says where it came from."""
    import warnings

    from fxpipe import cli

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    cli._one_line_warnings()
    line = warnings.formatwarning("the CP-SAT search ended on SIGABRT,\n  without an answer",
                                  RuntimeWarning, ilp_search.__file__, 1)
    assert line == "fxpipe: warning: the CP-SAT search ended on SIGABRT, without an answer\n"
    theirs = warnings.formatwarning("deprecated", UserWarning, "/elsewhere/model.py", 7)
    assert theirs.startswith("/elsewhere/model.py:7: UserWarning: deprecated")
