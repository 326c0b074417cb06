"""Tensor parallelism inside a host as plain data: each node's share of the work on t GPUs
(``Shard``, which the lowering reads off the graph: ``fxpipe.passes.tensor_parallel``) and
the problem priced at TP degree t (``tensor_sharded``).

# t: GPUs of one host that split each sharded op (the TP degree), ar(x): a ring
# all-reduce of x bytes over the t GPUs on the host's link (``ring_allreduce_s``).

The cost model, Megatron-LM's layout:

- a sharded op (a pair's column and row linears and the ops between them, a
  vocabulary-parallel embedding or LM head) runs 1/t of its FLOPs: its forward, backward
  and weight-gradient seconds are divided by t, and so are its parameters (and a tied
  group's, when every op reading it is sharded) but a row linear's bias, which every GPU
  holds whole (``Shard.whole_param_bytes``);
- the values a sharded op makes are split too (``Shard.values``: a column's output, what
  the ops between a pair save, the LM head's logits and so the loss's bytes), and so are
  the bytes that cross a stage boundary there; a row linear's output and an embedding's
  are whole after their all-reduce, as is every input a column reads;
- a pair adds ar(its output bytes) to its row linear's forward and ar(its input bytes) to
  its first column's backward; a vocabulary-parallel embedding adds ar(its output) to its
  forward, an LM head ar(its input) to its backward; not overlapped with compute;
- a replicated op is unchanged: its time, parameters and activations, on every GPU;
- with sequence parallelism (``passes/sequence_parallel.py``: the ops per token between a
  row and the next columns, on 1/t of the tokens, ``Shard.tokens``), their FLOPs, seconds
  and saved values divide by t, but what crosses a stage boundary is gathered and sent
  whole (an all-gather by the sender before the send and one of its gradient by the
  receiver after, each ar(x)/2, on the send both sides pay); the
  row's all-reduce becomes a reduce-scatter, ar(out)/2, and its backward an all-gather of
  the gradient, ar(out)/2; each value the next columns (or the LM head, or an op not per
  token) read is all-gathered, ar(x)/2, and its gradient reduce-scattered, ar(x)/2, which
  replaces the first column's backward all-reduce; a value entering from before (the
  embedding's output) is cut locally, and its gradient all-gathered, ar(x)/2; a norm's
  weight gradient, summed over the tokens, is all-reduced: the same bytes on the wire as
  the all-reduces, twice the collectives.

A node's transient gradient bytes are divided only where all it touches is split (the
ops between a pair); a column's or row's keeps its whole input's or output's gradient
(an upper bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from fxpipe.collectives import ring_allreduce_s
from fxpipe.partition.problem import Node, Problem

__all__ = ["REPLICATED", "Shard", "tensor_sharded"]


@dataclass(frozen=True)
class Shard:
    """How one node of the problem runs on the t GPUs of a host."""

    compute: bool = False  # its FLOPs, seconds and parameters are divided by t
    values: bool = False  # and the values it makes: its output, what it saves for backward
    inputs: bool = False  # the values it reads are split (its deferred W inputs)
    forward_reduce_bytes: int = 0  # all-reduced over the t GPUs after its forward
    backward_reduce_bytes: int = 0  # and in its backward
    # of its parameters, the bytes every GPU holds whole though its compute is split: a
    # row linear's bias, added once to the all-reduced sum (as Megatron-LM adds it)
    whole_param_bytes: int = 0
    # reduce-scattered or all-gathered over the t GPUs after its forward, each half a
    # ring all-reduce (sequence parallelism: a row's sums scattered along the tokens, a
    # value gathered where the ops per token end), and in its backward
    forward_halves: tuple[int, ...] = ()
    backward_halves: tuple[int, ...] = ()
    # it runs on 1/t of the tokens (sequence parallelism): its output is gathered whole
    # before it crosses a stage boundary (an all-gather there, and one of its gradient
    # on the other side) and received whole
    tokens: bool = False


REPLICATED = Shard()


def tensor_sharded(problem: Problem, shards: Sequence[Shard], t: int, *, bandwidth: float,
                   latency_s: float, pipeline_latency_s: float = 0.0) -> Problem:
    """``problem`` at TP degree t: each node priced by its ``Shard`` (the module
    docstring), the all-reduces on the host's link (``bandwidth``, ``latency_s``);
    ``pipeline_latency_s``: the latency of a stage boundary's send, which a split value
    still pays whole."""
    assert len(shards) == len(problem.nodes), (len(shards), len(problem.nodes))
    assert t >= 1, t
    if t == 1:
        return problem

    def ar(nbytes: int) -> float:
        return ring_allreduce_s(nbytes, t, bandwidth, latency_s) if nbytes else 0.0

    def halves(sizes: tuple[int, ...]) -> float:
        return sum(ar(nbytes) / 2 for nbytes in sizes)

    def node_at(node: Node, shard: Shard) -> Node:
        c = 1 / t if shard.compute else 1.0
        v = 1 / t if shard.values else 1.0
        sent = 1.0 if shard.tokens else v  # by tokens: gathered, then sent whole
        send_s = max(node.comm_s - pipeline_latency_s, 0.0)
        whole = min(shard.whole_param_bytes, node.param_bytes)
        # the sender's all-gather before the send, the receiver's of the gradient after:
        # a boundary charges comm_s to both sides, each ar(x)/2
        gathers = ar(node.output_bytes) / 2 if shard.tokens else 0.0
        forward_collective_s = ar(shard.forward_reduce_bytes) + halves(shard.forward_halves)
        backward_collective_s = ar(shard.backward_reduce_bytes) + halves(shard.backward_halves)
        return replace(
            node,
            forward_s=node.forward_s * c + forward_collective_s,
            backward_s=node.backward_s * c + backward_collective_s,
            forward_collective_s=forward_collective_s,
            backward_collective_s=backward_collective_s,
            backward_weight_s=node.backward_weight_s * c,
            param_bytes=_divided(node.param_bytes - whole, c) + whole,
            activation_bytes=_divided(node.activation_bytes, v),
            grad_bytes=_divided(node.grad_bytes, v if shard.inputs else 1.0),
            output_bytes=_divided(node.output_bytes, sent),
            comm_s=node.comm_s - send_s + send_s * sent + gathers,
            deferred_bytes=_divided(node.deferred_bytes, 1 / t if shard.inputs else 1.0),
            selective_bytes=tuple(_divided(b, v) for b in node.selective_bytes),
            selective_kept_s=tuple(s * c for s in node.selective_kept_s),
        )

    nodes = tuple(node_at(n, s) for n, s in zip(problem.nodes, shards, strict=True))
    tied = tuple(
        replace(g, param_bytes=-(-g.param_bytes // t), allreduce_s=g.allreduce_s / t)
        if all(shards[i].compute for i in g.nodes) else g for g in problem.tied)
    returned = [i for i, n in enumerate(problem.nodes) if n.returned]
    logits_split = bool(returned) and all(shards[i].values for i in returned)
    loss = 1 / t if logits_split else 1.0
    return replace(problem, nodes=nodes, tied=tied,
                   loss_saved_bytes=_divided(problem.loss_saved_bytes, loss),
                   loss_grad_bytes=_divided(problem.loss_grad_bytes, loss))


def _divided(nbytes: int, share: float) -> int:
    """``nbytes`` times ``share`` (1/t or 1), rounded up: a GPU holds whole bytes."""
    return nbytes if share == 1.0 else -(-nbytes // round(1 / share))
