"""fxpipe.runtime.microbatch: the one owner of batch splitting, and its inverses."""

from __future__ import annotations

import pytest
import torch

from fxpipe.runtime.microbatch import (
    batch_size,
    chunk_sizes,
    concat,
    lane_share,
    microbatch_count,
    rows_of,
    sample_share,
    split_microbatches,
    split_replicas,
)
from fxpipe.runtime.replicas import merge_replicas


def test_split_then_concat_is_the_identity() -> None:
    value = {"x": torch.arange(12.0).reshape(6, 2), "scale": 2.0, "step": torch.tensor(3)}
    parts = split_microbatches(value, 3)
    assert [p["x"].shape[0] for p in parts] == [2, 2, 2]
    assert all(p["scale"] == 2.0 and p["step"] is value["step"] for p in parts)
    merged = concat([{"x": p["x"], "scale": p["scale"]} for p in parts], [2, 2, 2])
    torch.testing.assert_close(merged["x"], value["x"])
    assert merged["scale"] == 2.0
    # a 0-dim output is not its micro-batches' stacked (nor, in general, their mean)
    with pytest.raises(ValueError, match=r"^the model's output\['step'\] is a 0-dim tensor"):
        concat(parts, [2, 2, 2])
    assert concat(parts[:1]) is parts[0]  # one micro-batch is the mini-batch


def test_split_with_copy_gives_each_microbatch_its_own_version_counter() -> None:
    x = torch.arange(6.0).reshape(6, 1)
    shared = split_microbatches(x, 3)
    shared[1].mul_(2)  # chunks of one tensor: a write to one bumps them all
    assert shared[0]._version == shared[2]._version == 1
    own = split_microbatches({"x": torch.arange(6.0).reshape(6, 1)}, 3, copy=True)
    own[1]["x"].mul_(2)
    assert [p["x"]._version for p in own] == [0, 1, 0]
    torch.testing.assert_close(own[2]["x"], torch.tensor([[4.0], [5.0]]))


def test_split_checks_the_batch_when_named() -> None:
    with pytest.raises(ValueError, match="batch size 2, fewer than the 3 micro-batches"):
        split_microbatches(torch.zeros(2, 4), 3, "target")


def test_uneven_batches_split_as_evenly_as_tensor_split() -> None:
    parts = split_microbatches(torch.arange(7.0).reshape(7, 1), 3, "input 'x'")
    assert [p.shape[0] for p in parts] == [3, 2, 2]
    torch.testing.assert_close(concat(parts), torch.arange(7.0).reshape(7, 1))


def test_a_batch_smaller_than_m_makes_fewer_microbatches() -> None:
    value = {"x": torch.zeros(2, 4), "mask": torch.zeros(2, 4), "scale": 1.0}
    assert microbatch_count(value, 4) == 2
    assert microbatch_count(value, 2) == 2
    assert microbatch_count({"scale": 1.0}, 4) == 4  # nothing to split: M copies
    with pytest.raises(ValueError, match="empty"):
        microbatch_count(torch.zeros(0, 4), 2)


def test_replicas_split_only_batched_leaves_and_merge_back() -> None:
    mask = torch.ones(1, 1, 5, 5)  # dim 0 is not the batch: whole to every replica
    x = torch.arange(10.0).reshape(5, 2)
    parts = split_replicas({"x": x, "mask": mask}, 5, 2)
    assert [p["x"].shape[0] for p in parts] == chunk_sizes(5, 2) == [3, 2]
    assert all(p["mask"] is mask for p in parts)
    merged = merge_replicas([(p["x"], p["mask"]) for p in parts], chunk_sizes(5, 2))
    torch.testing.assert_close(merged[0], x)
    assert merged[1] is mask


def test_batch_size_rows_and_lanes() -> None:
    x = torch.arange(8.0).reshape(8, 1)
    assert batch_size((3.0, torch.tensor(1), x)) == 8 and batch_size((1.0,)) is None
    torch.testing.assert_close(rows_of({"x": x}, 2, 4, 8)["x"], x[2:4])
    # lane 1 of 2 over 2 micro-batches of 4 rows: rows 2-3 of each micro-batch
    torch.testing.assert_close(lane_share(x, 1, 2, microbatches=2, what="x"),
                               x[[2, 3, 6, 7]])
    with pytest.raises(ValueError, match="multiple of 4"):
        lane_share(torch.zeros(6, 1), 0, 2, microbatches=2, what="the mini-batch")


def test_a_microbatch_loss_weighs_by_its_samples() -> None:
    assert [sample_share([3, 2, 2], m) for m in range(3)] == [3 / 7, 2 / 7, 2 / 7]
    assert sample_share([None, None], 0) == 0.5  # no batch dim: 1/M


def test_split_inputs_hands_shared_inputs_whole() -> None:
    """A (T, T) mask with T equal to the micro-batch count would split into rows that
    broadcast; named shared, every micro-batch gets all of it."""
    from fxpipe.runtime.microbatch import split_inputs

    x, mask = torch.arange(8.0).reshape(8, 1), torch.ones(4, 4).triu()
    parts = split_inputs({"x": x, "mask": mask}, 4, {"mask"})
    assert [p["x"].tolist() for p in parts] == [[[0.0], [1.0]], [[2.0], [3.0]],
                                                  [[4.0], [5.0]], [[6.0], [7.0]]]
    assert all(p["mask"] is mask for p in parts)
    assert [p["mask"].shape for p in split_inputs({"mask": mask}, 4, ())] == [(1, 4)] * 4
    with pytest.raises(ValueError, match=r"shared_inputs names \['ids'\]"):
        split_inputs({"x": x}, 2, {"ids"})


def test_torch_cuts_the_first_stage_inputs_as_split_inputs_does() -> None:
    """Under torchrun torch's schedule cuts the mini-batch; the chunk spec makes it cut as
    split_inputs does: the mask and position ids whole, the ids along dim 0 (unevenly
    too), a 0-dim tensor whole."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    from fxpipe.runtime.microbatch import split_inputs, torch_chunk_spec

    flat = {"ids": torch.arange(15).reshape(5, 3), "mask": torch.ones(5, 5).triu(),
            "position_ids": torch.arange(3).unsqueeze(0), "scale": torch.tensor(2.0)}
    shared = {"mask", "position_ids"}
    spec = torch_chunk_spec(list(flat), [tuple(v.shape) for v in flat.values()], shared)
    chunks, _ = split_args_kwargs_into_chunks(tuple(flat.values()), {}, 2, spec)
    ours = split_inputs(flat, 2, shared)
    assert len(chunks) == len(ours) == 2
    for theirs, mine in zip(chunks, ours, strict=True):
        for got, (name, want) in zip(theirs, mine.items(), strict=True):
            torch.testing.assert_close(got, want, msg=name)
        assert theirs[1] is flat["mask"] and theirs[2] is flat["position_ids"]
    assert [c[0].shape[0] for c in chunks] == [3, 2]


def test_shared_inputs_pass_whole_through_lanes_and_replica_rows() -> None:
    from fxpipe.runtime.microbatch import shared_leaves

    ids, mask = torch.arange(8.0).reshape(8, 1), torch.ones(8, 8).triu()
    flat = {"ids": ids, "mask": mask}
    whole = shared_leaves(flat, {"mask"})
    assert whole == {id(mask)}
    # lane 1 of 2 over 2 micro-batches of 4 rows: its rows of the ids, all of the mask
    args = lane_share((ids, mask), 1, 2, microbatches=2, what="x", whole=whole)
    assert args[0].flatten().tolist() == [2, 3, 6, 7] and args[1] is mask
    assert lane_share((ids, mask), 1, 2, microbatches=2, what="x")[1].shape == (4, 8)
    # a replica's rows of a micro-batch of 8 rows: the mask's 8 rows are not samples
    part = rows_of(flat, 4, 8, 8, whole={"mask"})
    assert part["ids"].flatten().tolist() == [4, 5, 6, 7] and part["mask"] is mask
