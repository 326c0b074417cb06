"""Which job rank runs what under a plan's layout of d pipelines (ranks.py), and what a
``DistributedPipeline`` refuses of it, without launching anything."""

from __future__ import annotations

import pytest

from fxpipe.runtime.pipelining import DistributedPipeline
from fxpipe.runtime.ranks import RankLayout


def test_a_layout_numbers_its_ranks_pipeline_by_pipeline() -> None:
    """rank i·pp + j: rank j of pipeline i, which is copy i of its stage."""
    layout = RankLayout(2, dp=3)
    assert [layout.copy_of(rank) for rank in range(6)] == [0, 0, 1, 1, 2, 2]
    assert layout.num_ranks == 2  # a pipeline's
    layout.check_world_size(6)
    with pytest.raises(ValueError, match=(
            r"^world size \(4\) must equal the number of GPUs of the plan's layout \(3 "
            r"data-parallel pipelines of 2 GPUs, 6 in all\): launch with torchrun "
            r"--nproc-per-node 6$")):
        layout.check_world_size(4)


def test_lanes_are_copies_of_their_stage() -> None:
    """"2-2": rank j·r + l runs stage j in lane l, one whole pipeline of each lane's."""
    layout = RankLayout(2, (2, 2))
    assert [layout.copy_of(rank) for rank in range(4)] == [0, 1, 0, 1]
    pipeline = layout.one_pipeline()
    assert (pipeline.num_ranks, pipeline.replicas) == (2, (1, 1))


@pytest.mark.parametrize(("data_parallel", "replicas"), [
    ((2, "zero"), ()), ((0, "fsdp"), ()), ((2, "ddp"), (2, 2))])
def test_a_pipeline_refuses_a_data_parallel_that_is_not_one(
        data_parallel: tuple[int, str], replicas: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"^data_parallel=.* replicate stages by the layout "
                       r"or by replicas, not both$"):
        DistributedPipeline(stage_classes=[object, object], wires=[(), ()], tied=[],
                            schedule="1f1b", microbatches=2, flatten_inputs=dict,
                            build_output=dict, replicas=replicas,
                            data_parallel=data_parallel)
