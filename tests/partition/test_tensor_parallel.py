"""The problem priced at TP degree t (fxpipe/partition/tensor_parallel.py): a sharded
node's work, parameters and values divided by t, a pair's all-reduces added on the host's
link, a replicated node unchanged."""

from __future__ import annotations

import pytest

from fxpipe.collectives import ring_allreduce_s
from fxpipe.partition.problem import Edge, Node, Problem, TiedGroup
from fxpipe.partition.tensor_parallel import REPLICATED, Shard, tensor_sharded

BW, LAT = 400e9, 2e-6  # the host's link
PIPE_LAT = 5e-6  # a stage boundary's send latency


def _node(name: str, **kw: object) -> Node:
    costs = dict(forward_s=8.0, backward_s=16.0, backward_weight_s=8.0, param_bytes=800,
                 activation_bytes=400, grad_bytes=240, output_bytes=160,
                 comm_s=160 / 1e9 + PIPE_LAT, deferred_bytes=80, selective_bytes=(40, 400),
                 selective_kept_s=(1.0, 4.0))
    costs.update(kw)
    return Node(name, **costs)  # type: ignore[arg-type]


def _problem() -> Problem:
    nodes = (_node("norm"), _node("column"), _node("attention"), _node("row"),
             _node("head", returned=True))
    return Problem(nodes, tuple(Edge(i, i + 1) for i in range(4)), num_stages=2,
                   tied=(TiedGroup("emb", (0, 4), 1000, allreduce_s=1.0),
                         TiedGroup("both", (1, 3), 1000, allreduce_s=1.0)),
                   loss_saved_bytes=320, loss_grad_bytes=320)


SHARDS = (REPLICATED,
          Shard(compute=True, values=True, backward_reduce_bytes=160),
          Shard(compute=True, values=True, inputs=True),
          Shard(compute=True, inputs=True, forward_reduce_bytes=160),
          Shard(compute=True, values=True, backward_reduce_bytes=160))


def _at(t: int) -> Problem:
    return tensor_sharded(_problem(), SHARDS, t, bandwidth=BW, latency_s=LAT,
                          pipeline_latency_s=PIPE_LAT)


def test_one_gpu_per_stage_is_the_problem_itself() -> None:
    assert _at(1) == _problem()


def test_a_replicated_node_is_unchanged() -> None:
    assert _at(4).nodes[0] == _problem().nodes[0]


def test_a_sharded_node_runs_a_t_th_of_its_work_on_a_t_th_of_its_values() -> None:
    inside = _at(4).nodes[2]
    assert (inside.forward_s, inside.backward_s, inside.backward_weight_s) == (2.0, 4.0, 2.0)
    assert (inside.param_bytes, inside.activation_bytes, inside.output_bytes) == (200, 100, 40)
    assert (inside.grad_bytes, inside.deferred_bytes) == (60, 20)
    assert inside.selective_bytes == (10, 100) and inside.selective_kept_s == (0.25, 1.0)
    # a quarter of the bytes cross a stage boundary, at the whole latency
    assert inside.comm_s == pytest.approx(40 / 1e9 + PIPE_LAT)


def test_a_pair_all_reduces_its_output_forward_and_its_input_gradient_backward() -> None:
    ar = ring_allreduce_s(160, 4, BW, LAT)
    assert ar > 0
    column, row = _at(4).nodes[1], _at(4).nodes[3]
    assert column.forward_s == 2.0 and column.backward_s == pytest.approx(4.0 + ar)
    assert row.forward_s == pytest.approx(2.0 + ar) and row.backward_s == 4.0
    # a row linear's output is whole after its all-reduce; its input (deferred W) is split
    assert (row.output_bytes, row.activation_bytes, row.deferred_bytes) == (160, 400, 20)
    # a column's input is whole: its deferred W input and its input's gradient too
    assert (column.deferred_bytes, column.grad_bytes, column.output_bytes) == (80, 240, 40)


def test_a_tied_group_splits_only_where_every_reader_does_and_split_logits_split_the_loss(
) -> None:
    sharded = _at(2)
    assert [g.param_bytes for g in sharded.tied] == [1000, 500]  # "emb" has a whole reader
    assert (sharded.loss_saved_bytes, sharded.loss_grad_bytes) == (160, 160)
    whole_head = tensor_sharded(_problem(), (*SHARDS[:4], REPLICATED), 2, bandwidth=BW,
                                latency_s=LAT)
    assert whole_head.loss_saved_bytes == 320


def test_the_all_reduce_grows_with_t_as_the_work_shrinks() -> None:
    rows = [_at(t).nodes[3].forward_s - 8.0 / t for t in (2, 4, 8)]
    assert rows == sorted(rows) and rows[0] > 0


def test_a_row_linears_bias_is_held_whole_on_every_gpu() -> None:
    """Of a row linear's 800 parameter bytes, 160 are its bias, which every GPU holds
    whole (Megatron adds it once after the all-reduce): 640 / 4 + 160 per GPU."""
    shards = (*SHARDS[:3], Shard(compute=True, inputs=True, forward_reduce_bytes=160,
                                 whole_param_bytes=160), SHARDS[4])
    row = tensor_sharded(_problem(), shards, 4, bandwidth=BW, latency_s=LAT).nodes[3]
    assert row.param_bytes == 640 // 4 + 160
    assert _at(4).nodes[3].param_bytes == 800 // 4  # no bias: all of it split


def test_sequence_parallelism_prices_halves_and_sends_whole() -> None:
    """An op on 1/t of the tokens (``Shard.tokens``) runs and saves 1/t, but what it sends
    across a stage boundary is gathered and sent whole (its output and send whole, plus
    an all-gather, half a ring all-reduce); a reduce-scatter or all-gather (``halves``)
    costs half a ring all-reduce of its bytes, so a row's reduce-scatter and the next
    column's all-gather cost its all-reduce."""
    t = 4
    half = ring_allreduce_s(160, t, BW, LAT) / 2
    tokens = Shard(compute=True, values=True, inputs=True, tokens=True)
    scattered = Shard(compute=True, inputs=True, forward_halves=(160,), backward_halves=(160,))
    sharded = tensor_sharded(_problem(), (tokens, *SHARDS[1:3], scattered, SHARDS[4]), t,
                             bandwidth=BW, latency_s=LAT, pipeline_latency_s=PIPE_LAT)
    norm, whole = sharded.nodes[0], _problem().nodes[0]
    assert (norm.forward_s, norm.activation_bytes, norm.grad_bytes) == (2.0, 100, 60)
    assert norm.output_bytes == whole.output_bytes
    assert norm.comm_s == pytest.approx(whole.comm_s + half)
    row, reduced = sharded.nodes[3], _at(t).nodes[3]
    assert row.forward_s == pytest.approx(reduced.forward_s - 2 * half + half)
    assert row.backward_s == pytest.approx(reduced.backward_s + half)
    assert 2 * half == pytest.approx(ring_allreduce_s(160, t, BW, LAT))
