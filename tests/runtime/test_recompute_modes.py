"""recompute_modes.py: a selective stage's keep rule is a typed value that prints as the
mode the plan and runner.py's RECOMPUTE name it by, and one function reads it back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fxpipe.plan import StagePlan, StageRecompute
from fxpipe.runtime.recompute_modes import KEEP_ALL, MODES, KeepRule, keep_rule, mode_name, modes

RULES = [KEEP_ALL, KeepRule(256, 128), KeepRule(0, 0, ((64, 32),)),
         KeepRule(8, 8, ((64, 32), (128, 16)))]


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_a_rule_prints_as_its_mode_and_reads_back(rule: KeepRule) -> None:
    mode = str(rule)
    assert keep_rule(mode) == rule
    assert mode_name(mode) == "selective" and modes([mode], 1) == (mode,)
    assert f"{rule}" == mode  # f-strings print it the same


def test_the_modes_it_prints() -> None:
    assert [str(rule) for rule in RULES] == [
        "selective", "selective:256:128", "selective:0:0:64x32",
        "selective:8:8:64x32,128x16"]


@pytest.mark.parametrize("mode", ["selective:1", "selective:a:2", "selective:1:2:3",
                                  "selective:1:2:3x", "selective:-1:2"])
def test_a_mode_that_is_no_rule_is_refused(mode: str) -> None:
    with pytest.raises(ValueError, match=r"is not selective:W:N\[:W1xN1,...\]"):
        keep_rule(mode)
    with pytest.raises(ValueError, match="is not one of none, selective, full"):
        modes([mode], 1)


def test_the_plan_writes_a_stage_mode_with_the_rule() -> None:
    """StagePlan.recompute_mode, what codegen writes into RECOMPUTE, is the rule's print."""
    def stage(recompute: StageRecompute, keeps: tuple[int, int] | None = None,
              skips: tuple[tuple[int, int], ...] = ()) -> StagePlan:
        return StagePlan(index=0, nodes=(), recompute=recompute, keeps=keeps, skips=skips)

    assert [stage(kind).recompute_mode for kind in StageRecompute] == list(MODES)
    assert stage(StageRecompute.NONE).keep_rule is None
    ruled = stage(StageRecompute.SELECTIVE, (256, 128), ((64, 32),))
    assert ruled.keep_rule == KeepRule(256, 128, ((64, 32),))
    assert ruled.recompute_mode == "selective:256:128:64x32"
    assert stage(StageRecompute.SELECTIVE, None, ((64, 32),)).recompute_mode == (
        "selective:0:0:64x32")


def test_the_words_load_no_torch() -> None:
    """The plan formats a mode with them, and the solver and the command line read the
    plan without torch."""
    code = ("import sys, fxpipe.plan, fxpipe.runtime.recompute_modes; "
            "print('torch' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
    assert found.stdout.strip() == "False"
