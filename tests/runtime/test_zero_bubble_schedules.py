"""The zero-bubble tick tables: valid, torch's own per-GPU orders, the published bubble.

Legend: K GPUs (stages for ZB-H1), M micro-batches; a tick is one action, F = I = W.

The bubble checked: a GPU's idle ticks are the table's length minus its actions (3M per
stage for ZB-H1, 6M per GPU for the two V chunks). ZB-H1's published bubble
(Qi et al., ICLR'24) is (K - 1)(T_F + T_B - T_W) with B the input gradient, K - 1 ticks
with unit costs; the same K - 1 is the fewest any table can have (the last GPU cannot
start before tick K - 1 and every GPU has the same number of actions). ZB-V and
DualPipeV reach it too, in ticks of half a stage.
"""

from __future__ import annotations

import types

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from fxpipe.schedules import (
    dualpipev,
    one_f_one_b,
    peak_deferred,
    peak_in_flight,
    render_ascii,
    v_devices,
    validate,
    zb1p,
    zbv,
)

all_gpus = range(1, 7)


def per_device(schedule, devices) -> dict[int, list[tuple[int, str, int]]]:
    order: dict[int, list[tuple[int, str, int]]] = {}
    for tick in schedule:
        for action in tick:
            order.setdefault(devices[action[0]], []).append(action)
    return order


@pytest.mark.parametrize("k", all_gpus)
def test_zb1p_valid_and_its_bubble_is_the_papers(k: int) -> None:
    for m in range(1, 3 * k + 2):
        table = zb1p(k, m)
        validate(table, k, m)
        idle = len(table) - 3 * m
        if m >= k:
            assert idle == (k - 1) * (1 + 1 - 1), (k, m, idle)
        else:
            assert idle >= k - 1
        # 1F1B with the backward as one tick of B = I + W: (K - 1)(T_F + T_B + T_W)
        assert len(one_f_one_b(k, m)) - 2 * m == 2 * (k - 1)


@pytest.mark.parametrize("make", [zbv, dualpipev])
@pytest.mark.parametrize("k", all_gpus)
def test_v_tables_valid_and_their_bubble_is_k_minus_1_chunk_ticks(make, k: int) -> None:
    devices = v_devices(k)
    for m in range(max(2 * k, 1), 4 * k + 1):
        table = make(k, m)
        validate(table, 2 * k, m, devices)
        assert len(table) - 6 * m == k - 1, (make.__name__, k, m)


def test_v_placement_goes_down_and_back_up() -> None:
    assert v_devices(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v_devices(1) == (0, 0)


@pytest.mark.parametrize("k", all_gpus)
def test_in_flight_activations_and_deferred_weights(k: int) -> None:
    m = 3 * k
    assert peak_in_flight(zb1p(k, m), k) == [k - j for j in range(k)], "1F1B's memory"
    assert peak_deferred(zb1p(k, m), k) == [j + 1 for j in range(k)]
    for make in (zbv, dualpipev):
        table = make(k, m)
        peaks = peak_in_flight(table, 2 * k)
        assert peaks == [2 * k - s for s in range(2 * k)]
        per_gpu = [peaks[d] + peaks[2 * k - 1 - d] for d in range(k)]
        assert per_gpu == [2 * k + 1] * k
    assert peak_deferred(zbv(k, m), 2 * k) == (
        [d + 1 for d in range(k)] + [k - d for d in range(1, k)] + [1])


def test_zb1p_by_hand_k3_m4() -> None:
    assert render_ascii(zb1p(3, 4), 3) == "\n".join([
        "stage 0 | F0 F1 F2 .. .. I0 W0 F3 I1 W1 I2 W2 I3 W3",
        "stage 1 | .. F0 F1 .. I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        "stage 2 | .. .. F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    ])


def test_validate_knows_input_and_weight_gradients() -> None:
    good = zb1p(2, 1)
    validate(good, 2, 1)
    swapped = [tuple((j, {"I": "W", "W": "I"}.get(kind, kind), m) for j, kind, m in tick)
               for tick in good]
    with pytest.raises(AssertionError):
        validate(swapped, 2, 1)  # W before its I
    no_weights = [tuple(a for a in tick if a[1] != "W") for tick in good]
    with pytest.raises(AssertionError, match="want F and B, or F, I and W"):
        validate([t for t in no_weights if t], 2, 1)
    # I(0, m) must wait for I(1, m): stage 1's input gradient is stage 0's output gradient
    early = [((1, "F", 0),), ((0, "F", 0),), ((0, "I", 0),), ((1, "I", 0),),
             ((0, "W", 0), (1, "W", 0))]
    with pytest.raises(AssertionError):
        validate(early, 2, 1)


def test_dualpipev_needs_2k_microbatches() -> None:
    with pytest.raises(ValueError, match="--microbatches 8"):
        dualpipev(4, 7)


# ------------------------------------------------- the orders torch.distributed runs

def torch_order(cls, k: int, m: int, rank: int) -> list[tuple[int, str, int]]:
    """torch's per-rank action list, its overlapped pairs and full backwards written
    as their parts (F, then I and W), as fxpipe's tables write them."""
    fake = types.SimpleNamespace(pp_group_size=k, _n_microbatches=m, num_stages=2 * k,
                                 n_local_stages=1, microbatches_per_round=m // max(1, m // k))
    actions = cls._calculate_single_rank_operations(fake, rank)
    order: list[tuple[int, str, int]] = []
    for action in actions:
        if action is None:
            continue
        for part in action.sub_actions or (action,):
            kind = part.computation_type.value
            if kind == "B":
                order += [(part.stage_index, "I", part.microbatch_index),
                          (part.stage_index, "W", part.microbatch_index)]
            else:
                order.append((part.stage_index, kind, part.microbatch_index))
    return order


@pytest.mark.parametrize("k,m", [(2, 4), (3, 6), (4, 8), (4, 13), (5, 12)])
def test_orders_are_torchs(k: int, m: int) -> None:
    zb_one = types.SimpleNamespace(pp_group_size=k, _n_microbatches=m, n_local_stages=1,
                                   microbatches_per_round=m // max(1, m // k))
    for rank in range(k):
        ours = per_device(zb1p(k, m), list(range(k)))[rank]
        theirs = [(a.stage_index, a.computation_type.value, a.microbatch_index)
                  for a in torch_schedules.ScheduleInterleavedZeroBubble
                  ._calculate_single_rank_operations(zb_one, rank) if a is not None]
        assert ours == theirs, rank
        for make, cls in ((zbv, torch_schedules.ScheduleZBVZeroBubble),
                          (dualpipev, torch_schedules.ScheduleDualPipeV)):
            assert per_device(make(k, m), v_devices(k))[rank] == torch_order(cls, k, m, rank)
