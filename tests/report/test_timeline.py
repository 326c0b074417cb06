import itertools
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import pytest

from fxpipe.report.timeline import (
    MAX_DRAWN_ACTIONS,
    action_times,
    bubble_fraction,
    draw_timeline,
    schedule_svg,
)
from fxpipe.schedules import Table, gpipe, interleaved_1f1b, interleaved_devices, one_f_one_b

# K: GPUs, v: virtual stages per GPU, M: micro-batches; balanced stages take t forward
# and 2t backward per GPU, split evenly over its v chunks.


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


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_bubble_of_gpipe_and_1f1b_is_the_textbook_formula(make) -> None:
    t = 0.010
    for k in range(1, 7):
        for m in range(1, 13):
            bubble = bubble_fraction(make(k, m), [t] * k, [2 * t] * k)
            assert bubble == pytest.approx((k - 1) / (m + k - 1), abs=1e-9), (k, m)


def test_bubble_of_interleaved_is_v_times_smaller() -> None:
    # Megatron's interleaved schedule reaches the paper's (K - 1) / (v * M + K - 1)
    # exactly for every size here (and backward = forward as well as 2 x forward):
    # e.g. K = 4, M = 8 gives 0.2727 for v = 1, 0.1579 for v = 2, 0.0857 for v = 4.
    t = 0.010
    for k in range(1, 7):
        for v in range(1, 5):
            for m in range(k, 4 * k + 1, k):
                schedule, devices = interleaved_1f1b(k, v, m), interleaved_devices(k, v)
                want = (k - 1) / (v * m + k - 1)
                for backward in (2 * t / v, t / v):
                    bubble = bubble_fraction(schedule, [t / v] * (k * v),
                                             [backward] * (k * v), devices)
                    assert bubble == pytest.approx(want, abs=1e-9), (k, v, m, backward)
                times = action_times(schedule, [t / v] * (k * v), [2 * t / v] * (k * v),
                                     devices)
                step = max(end for _s, end in times.values())
                assert step == pytest.approx((v * m + k - 1) * 3 * t / v), (k, v, m)


def test_a_gpu_runs_one_action_at_a_time() -> None:
    k, v, m = 2, 2, 4
    schedule, devices = interleaved_1f1b(k, v, m), interleaved_devices(k, v)
    forward, backward = [1.0, 2.0, 1.5, 0.5], [2.0, 3.0, 2.5, 1.0]
    times = action_times(schedule, forward, backward, devices)
    for d in range(k):
        spans = sorted(span for (j, _kind, _mb), span in times.items() if devices[j] == d)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # without the mapping the four stages would overlap on "their own" devices
    apart = action_times(schedule, forward, backward)
    assert max(e for _s, e in apart.values()) < max(e for _s, e in times.values())


def test_unbalanced_interleaved_bubble_is_measured_not_assumed() -> None:
    # a slow last chunk: the GPUs wait on it, more than the balanced formula says
    schedule, devices = interleaved_1f1b(2, 2, 4), interleaved_devices(2, 2)
    balanced = bubble_fraction(schedule, [1.0] * 4, [2.0] * 4, devices)
    slow = bubble_fraction(schedule, [1.0, 1.0, 1.0, 3.0], [2.0, 2.0, 2.0, 6.0], devices)
    assert balanced == pytest.approx(1 / 9) and slow > balanced + 0.05


def test_timeline_by_gpu(tmp_path) -> None:
    schedule, devices = interleaved_1f1b(2, 2, 4), interleaved_devices(2, 2)
    path = tmp_path / "interleaved.svg"
    makespan = draw_timeline(schedule, [1.0] * 4, [2.0] * 4, path,
                             title="interleaved", devices=devices)
    assert makespan == pytest.approx((2 * 4 + 2 - 1) * (1.0 + 2.0))  # (vM + K - 1)(f + b)
    svg = path.read_text()
    assert "gpu 1" in svg and "stage 3" not in svg and "3b" in svg
    assert "bubble 11%" in svg  # 1/9


def test_devices_must_be_one_per_stage() -> None:
    with pytest.raises(ValueError, match="3 devices for 4 stages"):
        action_times(interleaved_1f1b(2, 2, 2), [1.0] * 4, [1.0] * 4, [0, 1, 0])


def test_zero_bubble_tables_time_input_and_weight_gradients_apart(tmp_path) -> None:
    """Balanced stages with F = I = W = 1: 1F1B takes (M + K - 1)(F + B) with B = I + W;
    ZB-H1 takes 3M + (K - 1)(T_F + T_B - T_W) = 3M + K - 1; ZB-V on the same K GPUs
    (chunks of half a stage) takes 3M + (K - 1) / 2."""
    from fxpipe.schedules import v_devices, zb1p, zbv

    k, m = 4, 8
    ones = [1.0] * k
    one_f = action_times(one_f_one_b(k, m), ones, [2.0] * k)
    zb = action_times(zb1p(k, m), ones, [2.0] * k, backward_weight_s=ones)
    v = action_times(zbv(k, m), [0.5] * (2 * k), [1.0] * (2 * k), v_devices(k),
                     backward_weight_s=[0.5] * (2 * k))
    assert max(e for _s, e in one_f.values()) == (m + k - 1) * 3
    assert max(e for _s, e in zb.values()) == 3 * m + (k - 1)
    assert max(e for _s, e in v.values()) == 3 * m + (k - 1) / 2
    assert zb[(0, "W", 0)][1] - zb[(0, "W", 0)][0] == 1.0
    assert zb[(0, "I", 0)][0] >= zb[(1, "I", 0)][1], "I waits for the next stage's I"
    path = tmp_path / "zb.svg"
    draw_timeline(zb1p(k, m), ones, [2.0] * k, path, title="ZB-H1", backward_weight_s=ones)
    assert b"weight gradient (W)" in path.read_bytes()


def test_the_chart_draws_each_action_once_as_a_box_of_its_length(tmp_path) -> None:
    import xml.etree.ElementTree as ET

    schedule = one_f_one_b(3, 5)
    forward, backward = [1.0, 2.0, 1.5], [2.0, 4.0, 3.0]
    times = action_times(schedule, forward, backward)
    path = tmp_path / "chart.svg"
    makespan = draw_timeline(schedule, forward, backward, path, title="a <b> & c")
    root = ET.parse(path).getroot()  # well-formed, the title's markup escaped
    ns = "{http://www.w3.org/2000/svg}"
    boxes = [r for g in root.iter(f"{ns}g") if g.get("stroke") == "white"
             for r in g.iter(f"{ns}rect")]
    assert len(boxes) == len(times) == 3 * 5 * 2
    per_second = max(float(r.get("x")) + float(r.get("width")) for r in boxes) - min(
        float(r.get("x")) for r in boxes)
    per_second /= makespan
    widths = sorted(round(float(r.get("width")) / per_second, 2) for r in boxes)
    assert widths == sorted(round(end - start, 2) for start, end in times.values())
    bubble = bubble_fraction(schedule, forward, backward)
    assert next(t.text for t in root.iter(f"{ns}text")) == (
        f"a <b> & c  (step {makespan:.2f} s, bubble {bubble:.0%})")


@dataclass
class _Stage:
    forward_s: float = 1e-3
    backward_s: float = 2e-3
    comm_s: float = 0.0
    backward_weight_s: float = 0.0


@dataclass
class _Plan:
    """What schedule_svg reads of a plan, for K stage modules too many to plan here."""

    schedule: str
    num_stages: int
    microbatches: int
    virtual_stages: int = 1
    model: str = "deep.py:build_model"

    def __post_init__(self) -> None:
        self.stages = [_Stage() for _ in range(self.num_stages)]
        self.num_devices = self.num_stages // self.virtual_stages

    def devices_of(self, stage: int) -> tuple[int, ...]:
        if self.schedule in ("zbv", "dualpipev"):
            n = self.num_devices
            return (stage if stage < n else 2 * n - 1 - stage,)
        return (stage % self.num_devices,)

    def schedule_table(self) -> Table:
        raise AssertionError("the plan's whole table is built only to be drawn whole")


def _boxes(svg: bytes) -> int:
    """The chart's action boxes (the legend's swatches and the background aside)."""
    ns = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(svg)
    return sum(1 for g in root.iter(f"{ns}g") if g.get("stroke") == "white"
               for _ in g.iter(f"{ns}rect"))


@pytest.mark.parametrize(("schedule", "k", "v", "m", "drawn"), [
    ("1f1b", 1000, 1, 1024, 20),  # 2,048,000 actions: 2 x K per micro-batch
    ("zb1p", 1000, 1, 1024, 13),  # F, I and W: 3 x K
    ("interleaved", 256, 4, 1024, 64),  # a multiple of the 64 GPUs
])
def test_a_schedule_too_big_to_draw_is_drawn_with_fewer_micro_batches(
    schedule: str, k: int, v: int, m: int, drawn: int
) -> None:
    """A 1,000-stage plan with 1,024 micro-batches took half a minute and 158 MB to draw
    whole (more than 10 minutes on a loaded machine); its chart draws at most
    MAX_DRAWN_ACTIONS boxes, every row, and says under the chart what it left out."""
    svg = schedule_svg(_Plan(schedule, k, m, v))
    per_microbatch = k * (3 if schedule == "zb1p" else 2)
    assert _boxes(svg) == per_microbatch * drawn <= MAX_DRAWN_ACTIONS
    step = k // v if v > 1 else 1  # interleaved: a multiple of the GPUs
    assert per_microbatch * (drawn + step) > MAX_DRAWN_ACTIONS  # as many as fit
    rows = k // v
    name = "gpu" if v > 1 else "stage"
    assert f">{name} {rows - 1}</text>".encode() in svg
    assert (f"Drawn with {drawn} of the plan's {m} micro-batches, as all "
            f"{per_microbatch * m:,} actions are too many to draw").encode() in svg


def test_a_schedule_whose_kind_needs_too_many_micro_batches_is_named_not_drawn() -> None:
    """DualPipeV runs no fewer than 2 micro-batches per GPU: on 200 GPUs even those are
    more than MAX_DRAWN_ACTIONS, so the chart is its title and a line saying why."""
    svg = schedule_svg(_Plan("dualpipev", 400, 1024, 2))
    assert _boxes(svg) == 0
    assert b"actions are too many to draw (runner.py lists them)" in svg
    assert b"dualpipev, K=400, M=1024" in svg


def test_a_schedule_that_fits_is_drawn_whole_from_the_plan_s_table() -> None:
    plan = _Plan("1f1b", 4, 8)
    plan.schedule_table = lambda: one_f_one_b(4, 8)  # type: ignore[method-assign]
    svg = schedule_svg(plan)
    assert _boxes(svg) == 4 * 8 * 2 and b"Drawn with" not in svg
