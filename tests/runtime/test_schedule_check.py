"""fxpipe.runtime.schedule: the dependency rule and the table check the runner and
the compiler share."""

from __future__ import annotations

import pytest

from fxpipe.runtime.schedule import GRAD, check_schedule, dependencies
from fxpipe.schedules import gpipe, interleaved_1f1b, one_f_one_b


def test_dependencies() -> None:
    assert dependencies((0, "F", 2), 3) == []
    assert dependencies((1, "F", 2), 3) == [(0, "F", 2)]
    # stage 2's input gradient, made by its full backward B or by its I
    assert dependencies((1, "B", 2), 3) == [(1, "F", 2), (2, GRAD, 2)]
    assert dependencies((1, "I", 2), 3) == [(1, "F", 2), (2, GRAD, 2)]
    assert dependencies((1, "W", 2), 3) == [(1, "I", 2)]
    assert dependencies((2, "B", 2), 3) == [(2, "F", 2)]


@pytest.mark.parametrize(("table", "stages"), [
    (gpipe(3, 4), 3), (one_f_one_b(3, 4), 3), (interleaved_1f1b(2, 2, 4), 4),
])
def test_the_compiler_tables_pass(table: list, stages: int) -> None:
    check_schedule(table, stages, 4)


@pytest.mark.parametrize(("table", "message"), [
    ([((1, "F", 0),), ((0, "F", 0),), ((1, "B", 0),), ((0, "B", 0),)], "before"),
    ([((0, "F", 0), (0, "F", 0))], "twice"),
    ([((0, "F", 0),), ((1, "F", 0),), ((1, "B", 0),)], "want F and B, or F, I and W"),
    ([((1, "F", 0),), ((0, "F", 0),), ((1, "W", 0),)], "before"),
    ([((2, "F", 0),)], "outside 2 stages"),
])
def test_bad_tables_are_value_errors(table: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_schedule(table, 2, 1)
