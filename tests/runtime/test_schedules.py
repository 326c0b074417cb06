import pytest

from fxpipe.codegen.schedules import gpipe, one_f_one_b, peak_in_flight, render_ascii, validate

all_stages = range(1, 7)
all_microbatches = range(1, 9)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_every_size_is_valid_and_runs_each_action_once(make) -> None:
    for k in all_stages:
        for m in all_microbatches:
            schedule = make(k, m)
            validate(schedule, k, m)
            actions = [a for tick in schedule for a in tick]
            assert sorted(actions) == sorted(
                (j, kind, mb) for j in range(k) for kind in "FB" for mb in range(m)
            )


def test_peak_in_flight() -> None:
    for k in all_stages:
        for m in all_microbatches:
            assert peak_in_flight(gpipe(k, m), k) == [m] * k
            assert peak_in_flight(one_f_one_b(k, m), k) == [min(m, k - j) for j in range(k)]


def test_one_f_one_b_by_hand_k3_m4() -> None:
    # stage 0: F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    # stage 1: .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    # stage 2: .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..
    expected = [
        ((0, "F", 0),),
        ((0, "F", 1), (1, "F", 0)),
        ((0, "F", 2), (1, "F", 1), (2, "F", 0)),
        ((2, "B", 0),),
        ((1, "B", 0), (2, "F", 1)),
        ((0, "B", 0), (1, "F", 2), (2, "B", 1)),
        ((0, "F", 3), (1, "B", 1), (2, "F", 2)),
        ((0, "B", 1), (1, "F", 3), (2, "B", 2)),
        ((1, "B", 2), (2, "F", 3)),
        ((0, "B", 2), (2, "B", 3)),
        ((1, "B", 3),),
        ((0, "B", 3),),
    ]
    assert one_f_one_b(3, 4) == expected
    assert len(expected) == 2 * (4 + 3 - 1)  # unit-time F and B: 2(M + K - 1) ticks


def test_gpipe_is_fill_drain() -> None:
    schedule = gpipe(3, 4)
    kinds = [a[1] for tick in schedule for a in tick]
    assert kinds == sorted(kinds, key="FB".index)  # every F before every B
    assert len(schedule) == 2 * (4 + 3 - 1)


def test_render_ascii() -> None:
    assert render_ascii(one_f_one_b(3, 4), 3) == (
        "stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3\n"
        "stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..\n"
        "stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. .."
    )
    wide = render_ascii(gpipe(1, 11), 1)
    assert wide.startswith("stage 0 | F0  F1 ") and wide.endswith("B10")


@pytest.mark.parametrize(
    "schedule",
    [
        [((1, "F", 0),), ((0, "F", 0),), ((1, "B", 0),), ((0, "B", 0),)],  # F out of order
        [((0, "F", 0),), ((1, "F", 0),), ((0, "B", 0),), ((1, "B", 0),)],  # B out of order
        [((0, "F", 0), (1, "F", 0)), ((1, "B", 0),), ((0, "B", 0),)],  # same tick
        [((0, "F", 0), (0, "B", 0))],  # a stage twice in a tick
        [((0, "F", 0),), ((1, "F", 0),), ((1, "B", 0),)],  # missing action
    ],
)
def test_validate_rejects(schedule) -> None:
    with pytest.raises(AssertionError):
        validate(schedule, 2, 1)


def test_bad_sizes_are_user_errors() -> None:
    with pytest.raises(ValueError, match="micro-batches"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="stages"):
        one_f_one_b(0, 2)
