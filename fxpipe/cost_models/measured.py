"""The measured cost model: run the graph once, timing every node's forward and backward.

Each computing node (``call_module``, ``call_function``, ``call_method``) is run
on fresh copies of its real inputs: every tensor is detached and cloned
(so in-place ops touch neither the graph's values nor a leaf); one that
requires grad is cloned from a new leaf that requires grad. Then

- forward: ``warmup`` untimed runs, then the median of ``repeats`` timed runs;
- backward: one more forward, then ``warmup`` untimed and the median of
  ``repeats`` timed ``torch.autograd.grad`` calls of the outputs that require
  grad with respect to the input copies and the module's parameters that
  require grad, ``grad_outputs`` all ones, graph retained between calls.
  A node whose outputs do not require grad has backward 0.

On CUDA the ``repeats`` runs go back to back between one pair of
``torch.cuda.Event(enable_timing=True)`` (synchronising on the end event), and
the time is the median over 3 such brackets divided by ``repeats``: as in a
training step, each launch overlaps the kernels queued before it, so a small op
costs its dispatch and kernel rather than a synchronised round trip (timed one
by one, GPT-2 small's nodes summed to 1.7× its whole step on an H100:
BENCHMARKS.md). The backward differentiates ``repeats`` forwards on fresh copies
in one ``torch.autograd.grad`` call (the module's parameters collect the sum of
their gradients), so the engine's cost per call is paid once per bracket; a
bracket holds ``repeats`` copies of the node's inputs and graphs at once. The
caching allocator's figures for one more forward go into ``meta.MEASURED_MEMORY``:
bytes still allocated after it returns (its outputs and what autograd saved)
and the peak increase while it ran.

On the CPU ``time.perf_counter`` brackets each run; on a loaded machine
intra-op threads wait on each other for whole scheduler ticks (≈ 10 ms per op
on 2 busy cores), so measure on an idle host or with ``torch.set_num_threads``
below the number of free cores.

The value passed on to later nodes is that last forward's output, detached,
with its ``requires_grad`` kept, so the autograd graph of the whole model is
never held. In-place updates are therefore not visible to later nodes: the
timings are right, values that depend on a mutation may not be.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe import meta

__all__ = ["annotate_times"]

_COMPUTING_OPS = ("call_module", "call_function", "call_method")
_EXPORT_GUARD = "_guards_fn"  # torch.export's input check, a call_module of no model code
_BRACKETS = 3  # CUDA: event pairs around ``repeats`` back-to-back runs; the median is kept


def _fresh(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """Copies of every tensor in ``value`` safe to run an op on, and the leaves behind them.

    A tensor that requires grad becomes ``leaf.clone()`` of a new detached leaf,
    so an in-place op acts on a non-leaf and gradients flow back to ``leaf``.
    """
    leaves: list[torch.Tensor] = []

    def copy(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if not x.requires_grad:
            return x.detach().clone()
        leaf = x.detach().requires_grad_(True)
        leaves.append(leaf)
        return leaf.clone()

    return tree_map(copy, value), leaves


def _passed_on(value: Any) -> Any:
    """What later nodes see: detached tensors, ``requires_grad`` kept."""

    def detach(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().requires_grad_(x.requires_grad)

    return tree_map(detach, value)


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


class _Clock:
    """Times a callable: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: Literal["cpu", "cuda"]) -> None:
        self.cuda = device == "cuda"

    def seconds(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin

    def median(self, fn: Callable[[], object], *, warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(self.seconds(fn) for _ in range(repeats))


class _NodeTimer(torch.fx.Interpreter):
    """Runs ``gm`` once, writing ``meta.TIME`` (and on CUDA ``MEASURED_MEMORY``) per node."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        *,
        device: Literal["cpu", "cuda"],
        warmup: int,
        repeats: int,
    ) -> None:
        super().__init__(gm)
        self.clock = _Clock(device)
        self.cuda = device == "cuda"
        self.warmup = warmup
        self.repeats = repeats
        self.source = f"measured:{device}"

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op not in _COMPUTING_OPS or n.target == _EXPORT_GUARD:
            result = super().run_node(n)
            meta.TIME.set(n, meta.TimeInfo(0.0, 0.0, source=self.source))
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        op = getattr(self, n.op)

        def forward() -> Any:
            (fresh_args, fresh_kwargs), _ = _fresh((args, kwargs))
            return op(n.target, fresh_args, fresh_kwargs)

        def timed_forward() -> float:
            (fresh_args, fresh_kwargs), _ = _fresh((args, kwargs))
            return self.clock.seconds(lambda: op(n.target, fresh_args, fresh_kwargs))

        for _ in range(self.warmup):
            forward()
        if self.cuda:
            forward_s = self._forward_back_to_back(op, n.target, args, kwargs)
        else:
            forward_s = statistics.median(timed_forward() for _ in range(self.repeats))

        # The forward whose graph the backward runs on (and, on CUDA, whose memory is recorded).
        (fresh_args, fresh_kwargs), leaves = _fresh((args, kwargs))
        before = self._memory_start()
        output = op(n.target, fresh_args, fresh_kwargs)
        self._memory_end(n, before)

        if self.cuda:
            backward_s = self._backward_back_to_back(n, op, args, kwargs)
        else:
            backward_s = self._backward_seconds(n, leaves, output)
        # B and W are timed together; W gets the weight gradient's share of the FLOPs.
        share = meta.FLOPS.get(n).weight_share if meta.FLOPS.has(n) else 0.0
        meta.TIME.set(n, meta.TimeInfo(forward_s, backward_s, source=self.source,
                                       backward_weight_s=backward_s * share))
        return _passed_on(output)

    def _forward_back_to_back(self, op: Callable[..., Any], target: Any, args: Any,
                              kwargs: Any) -> float:
        """CUDA: seconds per forward, ``repeats`` of them back to back on fresh copies
        of the inputs (made before the events), the median over ``_BRACKETS`` pairs."""

        def bracket() -> float:
            copies = [_fresh((args, kwargs))[0] for _ in range(self.repeats)]

            def run() -> None:
                for fresh_args, fresh_kwargs in copies:
                    op(target, fresh_args, fresh_kwargs)

            return self.clock.seconds(run)

        return statistics.median(bracket() for _ in range(_BRACKETS)) / self.repeats

    def _backward_back_to_back(self, n: torch.fx.Node, op: Callable[..., Any], args: Any,
                               kwargs: Any) -> float:
        """CUDA: seconds per backward, ``repeats`` forwards on fresh copies differentiated
        by ONE ``torch.autograd.grad`` call, so their backward kernels queue back to back
        and the engine's per-call cost is paid once; the median over ``_BRACKETS``
        pairs of events (a warm-up bracket first)."""
        params = [p for p in self._parameters(n) if p.requires_grad]

        def bracket() -> float:
            outputs: list[torch.Tensor] = []
            wrt: list[torch.Tensor] = list(params)
            for _ in range(self.repeats):
                (fresh_args, fresh_kwargs), leaves = _fresh((args, kwargs))
                out = op(n.target, fresh_args, fresh_kwargs)
                outputs += [y for y in _tensors(out) if y.requires_grad and y.grad_fn is not None]
                wrt += leaves
            if not outputs or not wrt:
                return 0.0
            grad_outputs = [torch.ones_like(y) for y in outputs]
            return self.clock.seconds(
                lambda: torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True))

        try:
            bracket()  # warm-up
            return statistics.median(bracket() for _ in range(_BRACKETS)) / self.repeats
        except RuntimeError as error:
            raise RuntimeError(
                f"measuring the backward of {n.format_node()} failed: {error}"
            ) from error

    def _parameters(self, n: torch.fx.Node) -> Iterator[torch.Tensor]:
        if n.op == "call_module":
            assert isinstance(n.target, str)
            yield from self.fetch_attr(n.target).parameters()

    def _backward_seconds(self, n: torch.fx.Node, leaves: list[torch.Tensor], output: Any) -> float:
        outputs = [y for y in _tensors(output) if y.requires_grad and y.grad_fn is not None]
        wrt = leaves + [p for p in self._parameters(n) if p.requires_grad]
        if not outputs or not wrt:
            return 0.0
        grad_outputs = [torch.ones_like(y) for y in outputs]

        def backward() -> object:
            return torch.autograd.grad(
                outputs, wrt, grad_outputs, retain_graph=True, allow_unused=True
            )

        try:
            return self.clock.median(backward, warmup=self.warmup, repeats=self.repeats)
        except RuntimeError as error:
            raise RuntimeError(
                f"measuring the backward of {n.format_node()} failed: {error}"
            ) from error

    def _memory_start(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())

    def _memory_end(self, n: torch.fx.Node, before: int) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize()
        kept = int(torch.cuda.memory_allocated()) - before
        peak = int(torch.cuda.max_memory_allocated()) - before
        meta.MEASURED_MEMORY.set(n, meta.MeasuredMemory(kept_bytes=kept, peak_bytes=peak))


def _check_inputs(flat_inputs: tuple[Any, ...], device: str) -> None:
    for i, x in enumerate(flat_inputs):
        if isinstance(x, torch.Tensor) and x.device.type != device:
            raise ValueError(
                f"input {i} is on {x.device.type!r} but the graph is measured on {device!r}; "
                f"move the model and its inputs there first (model.to({device!r}))"
            )


def annotate_times(
    gm: torch.fx.GraphModule,
    *flat_inputs: Any,
    device: Literal["cpu", "cuda"] = "cpu",
    warmup: int = 2,
    repeats: int = 5,
) -> torch.fx.GraphModule:
    """Run ``gm`` on ``flat_inputs`` once, writing a measured ``meta.TIME`` on every node.

    ``flat_inputs`` are the graph's placeholders in order; ``gm`` and the inputs
    must already be on ``device``. Works on ``symbolic_trace`` graphs and on
    ``torch.export.export(m, args, strict=False).module()`` graphs.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"measured device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("cannot measure on 'cuda': torch.cuda.is_available() is False")
    if warmup < 0 or repeats < 1:
        raise ValueError(
            f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}"
        )
    _check_inputs(flat_inputs, device)
    with torch.enable_grad():
        _NodeTimer(gm, device=device, warmup=warmup, repeats=repeats).run(*flat_inputs)
    return gm
