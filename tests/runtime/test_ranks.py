"""fxpipe.runtime.ranks: which torchrun rank runs which stage."""

from __future__ import annotations

import pytest

from fxpipe.runtime.ranks import RankLayout


def test_uneven_replicas() -> None:
    layout = RankLayout(3, (1, 2, 1))
    assert layout.num_ranks == 4 and not layout.uniform and layout.lanes == 1
    assert [layout.position(r) for r in range(4)] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert layout.ranks_of(1) == (1, 2) and layout.stages_of(2) == (1,)
    with pytest.raises(ValueError, match="rank 4 has no stage"):
        layout.position(4)
    with pytest.raises(ValueError, match=r"GPUs of the plan \(1-2-1\).*nproc-per-node 4"):
        layout.check_world_size(3)


def test_interleaved_and_lanes() -> None:
    interleaved = RankLayout(4, virtual_stages=2, device_of=(0, 1, 0, 1))
    assert interleaved.num_ranks == 2 and interleaved.stages_of(1) == (1, 3)
    assert interleaved.ranks_of(2) == (0,)
    v_placed = RankLayout(4, virtual_stages=2, device_of=(0, 1, 1, 0))
    assert v_placed.stages_of(0) == (0, 3) and v_placed.stages_of(1) == (1, 2)
    assert v_placed.ranks_of(3) == (0,) and v_placed.position(1) == (1, 0)
    with pytest.raises(ValueError, match="rank 2 has no stage"):
        v_placed.position(2)
    lanes = RankLayout(2, (2, 2))
    assert lanes.uniform and lanes.lanes == 2 and lanes.position(3) == (1, 1)
    lanes.check_world_size(4)
