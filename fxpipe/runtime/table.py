"""The uneven-replica schedule: stages with different replica counts under torchrun.

# r_j: replicas of stage j, M: micro-batches, b: rows of a micro-batch.

Stages with different replica counts do not fit ``PipelineStage``, whose wires
join one rank to one rank. A ``TableStage`` runs them instead: every rank walks
the runner's ``SCHEDULE`` table and does its own stage's actions, sending each
replica the rows of a value that it takes (``dist.isend``/``irecv``, the wires
and adapters of adapter.py), and sending gradients back the same way::

    1-2, b = 4 rows:  stage 0 (rank 0) rows 0-3 ──┬─ rows 0-1 ─► stage 1 replica 0 (rank 1)
                                                  └─ rows 2-3 ─► stage 1 replica 1 (rank 2)

A shared graph input (a causal mask) and a tensor whose dim 0 is not the
micro-batch's rows go whole from the producer's replica 0 to every replica, and
their gradients for it are summed there. The last stage's replicas divide their
chunk's loss by r, so the gradients summed over each stage's replicas (and over
all copies of a tied parameter) are the whole micro-batch's. Each send matches a
receive at a later tick of the table, so no rank waits on one that waits on it.
"""

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from .adapter import StageAdapter, check_feed
from .microbatch import rows_of, split_inputs, split_microbatches

__all__ = ["TablePipeline", "TableSchedule", "TableStage"]


class TablePipeline(Protocol):
    """What a ``TableStage`` reads of the pipeline it belongs to (pipelining.py's
    ``DistributedPipeline``, which imports this module)."""

    @property
    def num_stages(self) -> int: ...
    @property
    def replicas(self) -> Sequence[int]: ...
    @property
    def first_rank(self) -> Sequence[int]: ...
    @property
    def shared_inputs(self) -> Collection[str]: ...
    @property
    def flatten_inputs(self) -> Callable[..., dict[str, Any]]: ...

    def reduce_grads(self, stage: Any) -> None: ...


class TableStage:
    """One rank's replica of a stage in a plan whose stages have different replica
    counts (see the module docstring): its adapter, where it sits, and the example
    tensors of one whole micro-batch (``rows`` along dim 0) that it receives and
    sends, which fix the shapes of what travels."""

    def __init__(self, pipeline: TablePipeline, adapter: StageAdapter, stage_index: int,
                 replica: int, device: torch.device, receives: tuple[torch.Tensor, ...],
                 sends: tuple[torch.Tensor, ...], rows: int) -> None:
        self.pipeline = pipeline
        self.submod = adapter  # named as on PipelineStage, so train scripts read both alike
        self.stage_index = stage_index
        self.replica = replica
        self.device = device
        self.receives = receives
        self.sends = sends
        self.send_names = adapter.sends or ()  # the names of ``sends`` (none at the last stage)
        self.rows = rows
        self.is_first = stage_index == 0
        self.is_last = stage_index == pipeline.num_stages - 1

    def chunk(self, j: int, i: int) -> tuple[int, int]:
        """Rows [lo, hi) of a micro-batch that replica i of stage j takes."""
        size = self.rows // self.pipeline.replicas[j]
        return i * size, (i + 1) * size

    def rank_of(self, j: int, i: int) -> int:
        return self.pipeline.first_rank[j] + i

    def batched(self, example: torch.Tensor, name: str) -> bool:
        """Whether the value ``name`` (of ``example``'s shape) is cut into the replicas'
        rows: not a shared graph input, and dim 0 the micro-batch's rows."""
        return (name not in self.pipeline.shared_inputs and example.dim() > 0
                and example.size(0) == self.rows)

    def peers(self, j: int) -> list[tuple[int, int, int]]:
        """(replica of stage j, lo, hi): the rows this replica shares with each of
        stage j's replicas, in row order."""
        lo, hi = self.chunk(self.stage_index, self.replica)
        shared = []
        for i in range(self.pipeline.replicas[j]):
            a, b = self.chunk(j, i)
            if max(lo, a) < min(hi, b):
                shared.append((i, max(lo, a), min(hi, b)))
        return shared


class TableSchedule:
    """The runner's schedule table run on ``TableStage``s with point-to-point sends
    (see the module docstring); ``step`` is one mini-batch of M micro-batches."""

    def __init__(self, stage: TableStage, table: Sequence[Sequence[tuple[int, str, int]]],
                 microbatches: int, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> None:
        self.stage = stage
        self.actions = [(kind, m) for tick in table for j, kind, m in tick
                        if j == stage.stage_index]
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        # (isend work, the tensor it sends): waited at the end of the step
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def step(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any
             ) -> torch.Tensor | None:
        stage, m_count = self.stage, self.microbatches
        lo, hi = stage.chunk(stage.stage_index, stage.replica)
        feeds: list[dict[str, Any]] = []
        if stage.is_first:
            values = stage.pipeline.flatten_inputs(*args, **kwargs)
            shared, names = stage.pipeline.shared_inputs, stage.submod.receives
            check_feed(names, stage.submod.input_shapes, [values[name] for name in names],
                       m_count, shared)
            feeds = [rows_of(v, lo, hi, stage.rows, whole=shared)
                     for v in split_inputs(values, m_count, shared)]
        targets = []
        if stage.is_last:
            if self.loss_fn is None:
                raise ValueError("the last stage needs loss_fn: build_schedule(stage, loss_fn)")
            targets = [rows_of(t, lo, hi, stage.rows) for t in split_microbatches(target, m_count)]
        saved: dict[int, tuple[list[Any], Any]] = {}
        total = torch.zeros((), device=stage.device)
        for kind, m in self.actions:
            if kind == "F":
                saved[m] = self._forward(m, feeds[m] if feeds else None,
                                         targets[m] if targets else None)
                if stage.is_last:
                    total += saved[m][1].detach()
            else:
                self._backward(m, *saved.pop(m))
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
        stage.pipeline.reduce_grads(stage)
        if not stage.is_last:
            return None
        group = stage.submod.replica_group
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    # ---------------------------------------------------------------- one action

    def _forward(self, m: int, feed: dict[str, Any] | None, target: Any
                 ) -> tuple[list[Any], Any]:
        stage = self.stage
        adapter = stage.submod
        if feed is not None:
            flat = [feed[name].to(stage.device) for name in adapter.receives]
        else:
            flat = [self._receive(m, i, x) for i, x in enumerate(stage.receives)]
        leaves = [x.detach().requires_grad_(ex.requires_grad)
                  for x, ex in zip(flat, stage.receives, strict=True)] if feed is None else flat
        out = adapter(*leaves)
        if stage.is_last:
            target = pytree.tree_map_only(torch.Tensor, lambda t: t.to(stage.device), target)
            assert self.loss_fn is not None
            r = stage.pipeline.replicas[stage.stage_index]
            loss = self.loss_fn(adapter.rebuild_output(out), target)
            return leaves, loss / (self.microbatches * r)
        for i, (y, ex) in enumerate(zip(out, stage.sends, strict=True)):
            self._send(m, i, y, ex)
        return leaves, out

    def _backward(self, m: int, leaves: list[Any], out: Any) -> None:
        stage = self.stage
        if stage.is_last:
            out.backward()
        else:
            grads = [self._receive_grad(m, i, ex) for i, ex in enumerate(stage.sends)]
            pairs = [(y, g) for y, g in zip(out, grads, strict=True)
                     if g is not None and y.requires_grad]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        if stage.is_first:
            return
        for i, (x, ex) in enumerate(zip(leaves, stage.receives, strict=True)):
            if ex.requires_grad:
                grad = x.grad if x.grad is not None else torch.zeros_like(x)
                self._send_grad(m, i, grad, ex)

    # ---------------------------------------------------------------- messages
    # A message's tag: (micro-batch, value, direction), unique between two ranks.

    @staticmethod
    def _tag(m: int, i: int, count: int, backward: bool) -> int:
        return (m * count + i) * 2 + int(backward)

    def _send(self, m: int, i: int, y: torch.Tensor, example: torch.Tensor) -> None:
        """Value i of micro-batch m to the next stage's replicas: the rows each takes,
        or (not batched) all of it from replica 0 to every replica."""
        stage, j = self.stage, self.stage.stage_index + 1
        tag = self._tag(m, i, len(stage.sends), backward=False)
        lo = stage.chunk(stage.stage_index, stage.replica)[0]
        if stage.batched(example, stage.send_names[i]):
            for peer, a, b in stage.peers(j):
                self._isend(y[a - lo:b - lo], stage.rank_of(j, peer), tag)
        elif stage.replica == 0:
            for peer in range(stage.pipeline.replicas[j]):
                self._isend(y, stage.rank_of(j, peer), tag)

    def _receive(self, m: int, i: int, example: torch.Tensor) -> torch.Tensor:
        """Value i of micro-batch m from the previous stage's replicas (this replica's rows)."""
        stage, j = self.stage, self.stage.stage_index - 1
        tag = self._tag(m, i, len(stage.receives), backward=False)
        if not stage.batched(example, stage.submod.receives[i]):
            return self._recv(example.shape, example, stage.rank_of(j, 0), tag)
        parts = [self._recv((b - a, *example.shape[1:]), example, stage.rank_of(j, peer), tag)
                 for peer, a, b in stage.peers(j)]
        return torch.cat(parts)

    def _send_grad(self, m: int, i: int, grad: torch.Tensor, example: torch.Tensor) -> None:
        """The gradient of received value i back to the replicas it came from."""
        stage, j = self.stage, self.stage.stage_index - 1
        tag = self._tag(m, i, len(stage.receives), backward=True)
        lo = stage.chunk(stage.stage_index, stage.replica)[0]
        if not stage.batched(example, stage.submod.receives[i]):
            self._isend(grad, stage.rank_of(j, 0), tag)
            return
        for peer, a, b in stage.peers(j):
            self._isend(grad[a - lo:b - lo], stage.rank_of(j, peer), tag)

    def _receive_grad(self, m: int, i: int, example: torch.Tensor) -> torch.Tensor | None:
        """The gradient of sent value i from the next stage's replicas (None: it has
        none); a value sent whole gets the sum of every replica's gradient."""
        if not example.requires_grad:
            return None
        stage, j = self.stage, self.stage.stage_index + 1
        tag = self._tag(m, i, len(stage.sends), backward=True)
        if stage.batched(example, stage.send_names[i]):
            rows = stage.rows // stage.pipeline.replicas[stage.stage_index]
            parts = [self._recv((b - a, *example.shape[1:]), example, stage.rank_of(j, peer), tag)
                     for peer, a, b in stage.peers(j)]
            assert sum(p.size(0) for p in parts) == rows
            return torch.cat(parts)
        if stage.replica != 0:  # replica 0 sent it, so its gradient goes there
            return torch.zeros(example.shape, dtype=example.dtype, device=stage.device)
        replicas = range(stage.pipeline.replicas[j])
        return torch.stack([self._recv(example.shape, example, stage.rank_of(j, peer), tag)
                            for peer in replicas]).sum(0)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, dst=dst, tag=tag), tensor))

    def _recv(self, shape: Sequence[int], example: torch.Tensor, src: int, tag: int
              ) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=example.dtype, device=self.stage.device)
        dist.recv(buffer, src=src, tag=tag)
        return buffer
