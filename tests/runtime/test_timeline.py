import pytest

from fxpipe.codegen.schedules import gpipe, one_f_one_b
from fxpipe.codegen.timeline import action_times, draw_timeline


def test_times_follow_dependencies_and_stage_order() -> None:
    times = action_times(one_f_one_b(2, 2), [1.0, 2.0], [3.0, 4.0])
    assert times[(0, "F", 0)] == (0.0, 1.0)
    assert times[(1, "F", 0)] == (1.0, 3.0)
    assert times[(1, "B", 0)] == (3.0, 7.0)
    assert times[(0, "F", 1)] == (1.0, 2.0)
    assert times[(1, "F", 1)] == (7.0, 9.0)  # stage 1 does B0 before F1 (1F1B order)
    assert times[(0, "B", 0)] == (7.0, 10.0)
    assert max(end for _s, end in times.values()) == 16.0


def test_gpipe_step_time_is_the_textbook_formula() -> None:
    k, m, f, b = 4, 8, 1.0, 2.0
    times = action_times(gpipe(k, m), [f] * k, [b] * k)
    assert max(end for _s, end in times.values()) == pytest.approx((m + k - 1) * (f + b))


def test_svg_is_written_and_byte_identical(tmp_path) -> None:
    args = (one_f_one_b(4, 8), [0.010, 0.012, 0.011, 0.015], [0.020, 0.024, 0.022, 0.030])
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    makespan = draw_timeline(*args, first, title="1F1B, K=4, M=8")
    draw_timeline(*args, second, title="1F1B, K=4, M=8")
    data = first.read_bytes()
    assert data.startswith(b"<?xml") and b"<svg" in data
    assert data == second.read_bytes()
    assert makespan > 8 * (0.015 + 0.030)


def test_mismatched_times_are_a_user_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="2 forward times and 3 backward"):
        draw_timeline(gpipe(2, 2), [1.0, 1.0], [1.0, 1.0, 1.0], tmp_path / "x.svg", title="x")
