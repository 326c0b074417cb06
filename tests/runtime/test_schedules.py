import pytest

from fxpipe.schedules import (
    chunk_label,
    gpipe,
    interleaved_1f1b,
    interleaved_devices,
    one_f_one_b,
    peak_in_flight,
    render_ascii,
    validate,
)

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


# Interleaved 1F1B. K: GPUs, v: virtual stages (chunks) per GPU, M: micro-batches.
all_gpus = range(1, 7)
all_virtual = range(1, 5)


def _interleaved_sizes():
    for k in all_gpus:
        for v in all_virtual:
            for m in range(k, 3 * k + 1, k):  # Megatron: M a multiple of K
                yield k, v, m


def test_interleaved_is_valid_one_action_per_gpu_per_tick() -> None:
    for k, v, m in _interleaved_sizes():
        schedule = interleaved_1f1b(k, v, m)
        devices = interleaved_devices(k, v)
        validate(schedule, k * v, m, devices)  # each action once, dependencies kept
        for tick in schedule:
            gpus = [devices[j] for j, _kind, _mb in tick]
            assert len(gpus) == len(set(gpus)), (k, v, m, tick)
        # unit-time actions: v * M forwards and as many backwards per GPU, K - 1 ticks
        # of fill and K - 1 of drain, so the bubble is (K - 1) / (v * M + K - 1)
        assert len(schedule) == 2 * (v * m + k - 1), (k, v, m)


def test_interleaved_with_one_chunk_is_one_f_one_b() -> None:
    for k in all_stages:
        for m in all_microbatches:  # any M: without chunks Megatron does not interleave
            assert interleaved_1f1b(k, 1, m) == one_f_one_b(k, m)


def test_interleaved_follows_megatrons_order() -> None:
    k, v, m = 4, 3, 8
    schedule = interleaved_1f1b(k, v, m)
    for d in range(k):
        mine = [a for tick in schedule for a in tick if a[0] % k == d]
        forwards = [a for a in mine if a[1] == "F"]
        backwards = [a for a in mine if a[1] == "B"]
        for i, (j, _kind, mb) in enumerate(forwards):  # chunk (i // K) % v, groups of K
            assert (j // k, mb) == ((i // k) % v, (i // (k * v)) * k + i % k)
        for i, (j, _kind, mb) in enumerate(backwards):  # the chunks in reverse
            assert (j // k, mb) == (v - 1 - (i // k) % v, (i // (k * v)) * k + i % k)
        warmup = min(v * m, (k - d - 1) * 2 + (v - 1) * k)
        first_backward = mine.index(backwards[0])
        assert first_backward == warmup + 1  # the warm-up, then one forward, one backward
        steady = mine[warmup : 2 * v * m - warmup]
        assert [a[1] for a in steady] == ["F", "B"] * (v * m - warmup)


def test_interleaved_by_hand_k2_v2_m4() -> None:
    schedule = interleaved_1f1b(2, 2, 4)
    # GPU 0 runs virtual stages 0 (a) and 2 (b), GPU 1 stages 1 (a) and 3 (b)
    assert render_ascii(schedule, 4, devices=interleaved_devices(2, 2)) == (
        "gpu 0 | F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a ... B2b ... B3b B2a B3a\n"
        "gpu 1 | ... F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a ..."
    )
    # Read off the rows above: stage 0 runs F0 F1 F2 F3 (ticks 0, 1, 4, 6) before its
    # first backward (tick 9): 4. Stage 1: F0 F1 F2 (ticks 1, 2, 7) before B0 (tick 8):
    # 3. Stage 2: F0 F1 (ticks 2, 3), then B0 before F2: 2. Stage 3 runs B(m) right
    # after F(m): 1.
    assert peak_in_flight(schedule, 4) == [4, 3, 2, 1]


def test_interleaved_in_flight_is_megatrons_warmup() -> None:
    for k, v, m in _interleaved_sizes():
        schedule = interleaved_1f1b(k, v, m)
        peaks = peak_in_flight(schedule, k * v)
        # per GPU: the activation sets of all its chunks held at once
        held, most = [0] * k, [0] * k
        for tick in schedule:
            for j, kind, _mb in tick:
                held[j % k] += 1 if kind == "F" else -1
                most[j % k] = max(most[j % k], held[j % k])
        for d in range(k):
            # the warm-up forwards plus the steady state's forward before each backward
            # (v = 1: Megatron's 1F1B without interleaving, K - d - 1 warm-up forwards)
            warmup = k - d - 1 if v == 1 else (k - d - 1) * 2 + (v - 1) * k
            warmup = min(v * m, warmup)
            assert most[d] == min(v * m, warmup + 1), (k, v, m, d)
            chunks = [peaks[c * k + d] for c in range(v)]
            assert max(chunks) <= most[d] <= sum(chunks), (k, v, m, d, chunks)
            assert all(1 <= p <= m for p in chunks), (k, v, m, d, chunks)


def test_validate_rejects_two_stages_of_one_gpu_in_a_tick() -> None:
    schedule = gpipe(2, 1)  # stages 0 and 1 never share a tick ...
    validate(schedule, 2, 1, devices=[0, 0])
    together = [((0, "F", 0),), ((1, "F", 0),), ((1, "B", 0), (0, "F", 1)),
                ((0, "B", 0),), ((1, "F", 1),), ((1, "B", 1),), ((0, "B", 1),)]
    validate(together, 2, 2)  # ... and this table is valid on two GPUs ...
    with pytest.raises(AssertionError, match="a device runs twice"):
        validate(together, 2, 2, devices=[0, 0])  # ... not on one


@pytest.mark.parametrize(
    ("k", "v", "m", "match"),
    [
        (4, 2, 6, r"micro-batches \(6\) to be a multiple of the GPUs \(4\): use --microbatches 8"),
        (2, 3, 1, r"micro-batches \(1\) to be a multiple of the GPUs \(2\): use --microbatches 2"),
        (2, 0, 4, r"virtual stages per GPU \(0\) must be at least 1"),
        (0, 2, 4, r"GPUs \(0\) must be at least 1"),
        (2, 2, 0, r"micro-batches \(0\) must be at least 1"),
    ],
)
def test_interleaved_bad_sizes_are_user_errors(k: int, v: int, m: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        interleaved_1f1b(k, v, m)


def test_chunk_labels() -> None:
    assert [chunk_label(c) for c in (0, 1, 25, 26, 27, 701, 702)] == [
        "a", "b", "z", "aa", "ab", "zz", "aaa"
    ]


def test_render_ascii_by_device_wraps_and_labels_chunks() -> None:
    schedule = interleaved_1f1b(2, 3, 2)
    text = render_ascii(schedule, 6, devices=interleaved_devices(2, 3), width=40)
    blocks = text.split("\n\n")
    assert len(blocks) > 1 and all(len(line) <= 40 for line in text.splitlines())
    assert blocks[0].splitlines()[1].startswith("gpu 0 | F0a F1a F0b")
    assert "F1c" in text and "B0c" in text and "F0d" not in text
