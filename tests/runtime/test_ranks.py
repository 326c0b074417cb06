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


# the three placements torch's schedule classes assume, 4 stages each
ONE_PER_RANK = RankLayout(4)
LOOP = RankLayout(4, virtual_stages=2, device_of=(0, 1, 0, 1))
V = RankLayout(4, virtual_stages=2, device_of=(0, 1, 1, 0))
PLACEMENT = {"gpipe": ONE_PER_RANK, "1f1b": ONE_PER_RANK, "zb1p": ONE_PER_RANK,
             "interleaved": LOOP, "zbv": V, "dualpipev": V}


@pytest.mark.parametrize("planned", sorted(PLACEMENT))
@pytest.mark.parametrize("kind", sorted(PLACEMENT))
def test_a_schedule_runs_only_where_it_places_the_stages_as_planned(planned: str,
                                                                    kind: str) -> None:
    layout = PLACEMENT[planned]
    if PLACEMENT[kind] is layout:
        layout.check_placement(kind, planned)
        return
    with pytest.raises(ValueError, match=rf"^this plan was split for {planned}, stage j on "
                       rf"rank \[[0-9, ]+\]\[j\]; {kind} runs .*: split again with "
                       rf"--schedule {kind}$"):
        layout.check_placement(kind, planned)


def test_a_refused_schedule_says_where_each_would_run_the_stages() -> None:
    with pytest.raises(ValueError, match=r"^this plan was split for zbv, stage j on rank "
                       r"\[0, 1, 1, 0\]\[j\]; interleaved runs several stages per rank, stage "
                       r"j on rank j % 2 \(4 stages on 2 ranks\): split again with --schedule "
                       r"interleaved$"):
        V.check_placement("interleaved", "zbv")
    with pytest.raises(ValueError, match=r"^this plan was split for dualpipev, stage j on rank "
                       r"\[0, 1, 1, 0\]\[j\]; 1f1b runs one stage per rank \(4 stages on 2 "
                       r"ranks\): split again with --schedule 1f1b$"):
        V.check_placement("1f1b", "dualpipev")
    with pytest.raises(ValueError, match=r"^this plan was split for 1f1b, stage j on rank "
                       r"\[0, 1, 2, 3\]\[j\]; zbv runs on torch's ScheduleZBVZeroBubble with "
                       r"exactly 2 stages per rank in a V, rank r running stages r and 3 - r "
                       r"\(4 stages on 4 ranks\): split again with --schedule zbv$"):
        ONE_PER_RANK.check_placement("zbv", "1f1b")
    with pytest.raises(ValueError, match=r"no torch.distributed.pipelining class runs schedule "
                       r"'zb'; under torchrun use one of \['1f1b', 'dualpipev', 'gpipe', "
                       r"'interleaved', 'zb1p', 'zbv'\]"):
        V.check_placement("zb", "zbv")
    # one rank: interleaved and the V put both stages on it alike
    RankLayout(2, virtual_stages=2, device_of=(0, 0)).check_placement("zbv", "interleaved")


def test_stages_split_over_tp_ranks_count_every_rank_of_the_mesh() -> None:
    """pp 2 x tp 2 (x dp 2): the job's rank (i·pp + j)·tp + k; a pipeline's copy is i, and
    the world size counts every split GPU."""
    split = RankLayout(2, tp=2)
    assert [split.copy_of(r) for r in range(4)] == [0, 0, 0, 0]
    split.check_world_size(4)
    with pytest.raises(ValueError, match=r"^world size \(2\) must equal the number of GPUs "
                       r"of the plan's layout \(1 pipeline of 2 ranks, each rank's stages "
                       r"split over 2 GPUs, 4 in all\): launch with torchrun "
                       r"--nproc-per-node 4$"):
        split.check_world_size(2)
    both = RankLayout(2, dp=2, tp=2)
    assert [both.copy_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    both.check_world_size(8)
