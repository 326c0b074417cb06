"""Run pipeline stage modules on a clock-tick schedule.

This module is copied verbatim into every generated ``runner.py`` after a
header that defines ``SCHEDULE``, ``MICROBATCHES``, ``RECOMPUTE``, ``REPLICAS``,
``WEIGHT_STASHING``, ``GRAPH_INPUTS``, ``flatten_inputs`` and ``build_output``;
it imports only torch and the standard library.

# K: stages, M: micro-batches, j/k: a stage, m: a micro-batch.

A schedule is a list of clock ticks, each a tuple of ``(stage, "F" | "B", m)``
actions that may run at the same time. 1F1B with K = 3, M = 4::

    stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..
              ── tick ──►      Fm: forward of micro-batch m, Bm: its backward

How a step moves data::

    values[m]: name -> value          (graph inputs, split along dim 0, and every
         │                              stage output of micro-batch m)
         ├─► F(k, m): inputs = detached leaves of values[m][name] for name in INPUTS,
         │            requires_grad copied from the producer; outputs -> values[m]
         │            (k = K - 1: loss_m = loss_fn(build_output(values[m]), target_m) / M)
         └─◄ B(k, m): torch.autograd.backward(outputs that require grad, their grads)
                      (k = K - 1: the loss); the grads of k's input leaves are
                      added to grads[m][name] of the producer, summed over consumers

On the CPU (``devices=None``) the ticks run in order on one thread. On CUDA
every stage runs on its device on its own compute stream; a value that crosses
devices is copied on the destination device's copy stream, ordered by CUDA
events (producer records, copy stream waits, copies non_blocking, records,
consumer waits) and kept alive across streams with ``record_stream``. Nothing
synchronizes the device inside a step; the caller's current streams wait for
the stages at the end of it.

Tied parameters: a Parameter bound into a stage whose device is not the
Parameter's own (a GPT embedding reused by an LM head on another GPU) is
replaced, for the duration of one ``step``/``forward``, by a fresh copy on that
stage's device; after the step each copy's gradient is added into the original
Parameter's ``.grad``. The optimizer sees only the original Parameter, and
state_dict keys never change. Buffers are treated the same way, without
gradients (in-place buffer updates on a copy are lost).

``step`` accumulates into ``.grad`` exactly as ``loss.backward()`` would: call
``optimizer.zero_grad()`` before it. Gradients equal the unsplit model's over
the mini-batch when ``loss_fn`` is a mean over the batch and the micro-batches
are equal-sized (the mini-batch size is a multiple of M).

Replicated stages (PipeDream's "2-1-1"), ``replicas[k] = r > 1``: stage k runs
data-parallel. Each micro-batch's inputs to it are split along dim 0 into r
chunks (``torch.tensor_split``), the stage runs on every chunk and the chunk
outputs are concatenated back along dim 0, all inside autograd::

    F(0, m) | inputs ─┬─ chunk 0 ─► replica 0 (devices[0][0]) ─┬─ cat ─► F(1, m) ─► ...
            |         └─ chunk 1 ─► replica 1 (devices[0][1]) ─┘

so the backward splits the output gradient, and the r chunks' parameter
gradients are summed into the stage's parameters: the sum a data-parallel
all-reduce computes. Which values are split: an input tensor leaf whose dim 0
equals the micro-batch's batch size (dim 0 of its first graph-input tensor with
dim > 0); an output tensor leaf is concatenated when its dim 0 equals every
replica's chunk size. Anything else (0-dim tensors, non-tensors, a causal mask
of shape (1, 1, T, T)) goes whole to every replica, and as an output is taken
from replica 0. Limits: only a stage that treats samples independently is
transparent when replicated; one that mixes samples across the batch
(BatchNorm in training mode, which warns; a batch mean returned as an output)
sees chunk statistics instead of the micro-batch's; and a non-batched tensor
whose dim 0 happens to equal the batch size (an output: the chunk size, e.g.
one sample per chunk) is taken for a batched one. On the CPU the r chunks run
one after another on the same module; on CUDA ``devices[k]`` may be a sequence
of r devices: replica i runs on ``devices[k][i]`` with copies of the stage's
Parameters and buffers bound there, as for tied parameters above (a replica on
the stage's own device runs the module itself).

Weight stashing (PipeDream's asynchronous 1F1B; Harlap, Narayanan et al., SOSP
2019), ``weight_stashing=True``: ``step(..., optimizers=opts)`` with one
optimizer per stage updates stage k's weights right after every backward
B(k, m) (``opts[k].step()``, then ``opts[k].zero_grad()``). The forward F(k, m)
uses the weights current at that moment, and B(k, m) uses that same version,
stashed at F(k, m), not the newer live ones. Version v of a stage is its
weights after v updates; 1F1B with K = 2, M = 4::

    stage 0 | F0 F1 .. B0 F2 B1 F3 B2 .. B3     F(0, m) uses version max(0, m - 1)
    uses    | v0 v0 .. v0 v1 v0 v2 v1 .. v2     B(0, m) the version F(0, m) used
    makes   |          v1    v2    v3    v4     opts[0].step() after each B
    stage 1 | .. F0 B0 F1 B1 F2 B2 F3 B3 ..     F(1, m) and B(1, m) use version m

Each micro-batch is its own update: its loss is not divided by M, and ``step``
returns the mean loss over the micro-batches. The gradient of B(k, m) replaces
(not adds to) ``.grad`` of stage k's Parameters before ``opts[k].step()``. A
Parameter may belong to one stage only. Memory: F(k, m) copies stage k's
Parameters that require grad (micro-batches starting on the same version share
one copy), and a copy is freed after the last B that uses it, so stage k holds
at most one parameter copy per micro-batch in flight (exactly that many in
1F1B's steady state, where every in-flight micro-batch has its own version).
Recompute re-runs the forward with the stashed copy.
"""


import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["PipelineRunner"]

Action = tuple[int, str, int]  # (stage, "F" | "B", microbatch)
Device = torch.device | str | int
_GRAPH_INPUT = -1  # producer index of a value that comes from the caller
Stash = dict[str, torch.Tensor]  # weight stashing: parameter name -> its copy at F(k, m)


class PipelineRunner:
    """Execute ``stages`` (modules with ``INPUTS``/``OUTPUTS`` name tuples whose
    forward takes inputs by name and returns a tuple in ``OUTPUTS`` order) on a
    clock-tick ``schedule`` of ``microbatches`` micro-batches.

    ``replicas[k]`` (default 1) runs stage k data-parallel on that many chunks of
    every micro-batch, and ``devices[k]`` may then list one device per replica;
    ``weight_stashing`` makes ``step`` update every stage after each of its
    backwards with the optimizers it is given (see the module docstring)."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[Device | Sequence[Device]] | None = None,
        *,
        schedule: Sequence[Sequence[Action]],
        microbatches: int,
        flatten_inputs: Callable[..., dict[str, Any]],
        build_output: Callable[[dict[str, Any]], Any],
        recompute: Sequence[bool] | None = None,
        replicas: Sequence[int] | None = None,
        weight_stashing: bool = False,
    ) -> None:
        num_stages = len(stages)
        if num_stages < 1:
            raise ValueError("PipelineRunner needs at least one stage.")
        if microbatches < 1:
            raise ValueError(f"Number of micro-batches ({microbatches}) must be at least 1.")
        if devices is not None and len(devices) != num_stages:
            raise ValueError(
                f"Got {len(devices)} devices for {num_stages} stages: pass one device per "
                f"stage (or devices=None to run every stage on the CPU in order)."
            )
        if recompute is None:
            recompute = [False] * num_stages
        if len(recompute) != num_stages:
            raise ValueError(
                f"recompute has {len(recompute)} entries for {num_stages} stages: pass one "
                f"bool per stage."
            )
        if replicas is None:
            replicas = [1] * num_stages
        if len(replicas) != num_stages:
            raise ValueError(
                f"replicas has {len(replicas)} entries for {num_stages} stages: pass one "
                f"int per stage (1 for a stage that is not replicated)."
            )
        for k, r in enumerate(replicas):
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ValueError(
                    f"Stage {k} has replicas={r!r}: the number of replicas of a stage must "
                    f"be an int of at least 1."
                )
        self.stages = list(stages)
        self.schedule = [tuple((int(j), str(kind), int(m)) for j, kind, m in tick)
                         for tick in schedule]
        self.microbatches = microbatches
        self.flatten_inputs = flatten_inputs
        self.build_output = build_output
        self.recompute = [bool(r) for r in recompute]
        self.replicas = [int(r) for r in replicas]
        self.weight_stashing = bool(weight_stashing)
        _check_schedule(self.schedule, num_stages, microbatches)
        if self.weight_stashing:
            _check_unshared(self.stages)

        self._inputs: list[tuple[str, ...]] = []
        self._outputs: list[tuple[str, ...]] = []
        self._producer: dict[str, int] = {}
        for k, stage in enumerate(self.stages):
            try:
                ins = tuple(getattr(stage, "INPUTS"))  # noqa: B009 (class attributes, not Tensors)
                outs = tuple(getattr(stage, "OUTPUTS"))  # noqa: B009
            except AttributeError:
                raise TypeError(
                    f"Stage {k} ({type(stage).__name__}) has no INPUTS/OUTPUTS class "
                    f"attributes: stages must name the values they read and produce."
                ) from None
            self._inputs.append(ins)
            self._outputs.append(outs)
            for name in outs:
                if name in self._producer:
                    raise ValueError(
                        f"Value {name!r} is produced by stage {self._producer[name]} and "
                        f"stage {k}: every value must have one producer."
                    )
                self._producer[name] = k
        for k, ins in enumerate(self._inputs):
            for name in ins:
                p = self._producer.get(name, _GRAPH_INPUT)
                if p >= k:
                    raise ValueError(
                        f"Stage {k} reads {name!r}, produced by stage {p}: a stage can only "
                        f"read values of earlier stages or graph inputs."
                    )

        # devices[k]: stage k's own device (its replica 0's); replica_devices[k][i]: replica i's
        self.devices: list[torch.device] | None = None
        self.replica_devices: list[list[torch.device]] | None = None
        self._streams: list[Any] = [None] * num_stages
        self._copy_streams: dict[torch.device, Any] = {}
        self._send_streams: dict[torch.device, Any] = {}
        # (k, i) -> Parameters and buffers of stage k copied to replica i's device, bound for
        # one step/forward by _device_copies (absent: replica i runs on the stage's device)
        self._bound: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        if devices is not None:
            self.replica_devices = [
                _replica_devices(k, d, r)
                for k, (d, r) in enumerate(zip(devices, self.replicas, strict=True))
            ]
            self.devices = [devs[0] for devs in self.replica_devices]
            for k, dev in enumerate(self.devices):
                if dev.type == "cuda":
                    self._streams[k] = torch.cuda.Stream(dev)
                    if dev not in self._copy_streams:
                        self._copy_streams[dev] = torch.cuda.Stream(dev)
                        self._send_streams[dev] = torch.cuda.Stream(dev)

    # ------------------------------------------------------------------ API

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Inference on a mini-batch: split it into M micro-batches, run every
        stage forward under ``no_grad`` and concatenate the outputs along dim 0."""
        values = self._split(self.flatten_inputs(*args, **kwargs), "input")
        batch = self._batch_sizes(values)
        last = len(self.stages) - 1
        events: list[dict[int, Any]] = [{} for _ in range(self.microbatches)]
        outputs = []
        with torch.no_grad(), self._device_copies(), self._streams_joined():
            for tick in self.schedule:
                for k, kind, m in tick:
                    if kind == "F":
                        self._forward(k, values[m], grad=False, events=events[m],
                                      batch=batch[m])
            for m in range(self.microbatches):
                with self._on(last):
                    outputs.append(self.build_output(self._lazy(values[m], last, False, events[m])))
                values[m] = {}
            with self._on(last):
                return _concat(outputs)

    __call__ = forward

    def step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
             optimizers: Sequence[torch.optim.Optimizer | None] | None = None) -> Any:
        """Forward and backward of the mini-batch ``inputs`` (a tuple of positional
        arguments or a dict of keyword arguments) against ``target``; gradients
        accumulate into the stages' parameters. Returns the mean loss, detached.

        With ``weight_stashing``, ``optimizers`` (one per stage, over that stage's
        parameters; None for a stage without trainable parameters) update each stage
        after every micro-batch's backward instead."""
        self._check_optimizers(optimizers)
        if isinstance(inputs, Mapping):
            flat = self.flatten_inputs(**inputs)
        elif isinstance(inputs, tuple | list):
            flat = self.flatten_inputs(*inputs)
        else:
            flat = self.flatten_inputs(inputs)
        values = self._split(flat, "input")
        state = _StepState(
            values=values,
            targets=_split_tree(target, self.microbatches, "target"),
            loss_fn=loss_fn,
            batch=self._batch_sizes(values),
        )
        if self.weight_stashing:
            assert optimizers is not None  # checked above
            state.optimizers = list(optimizers)
            # the live Parameters, before _device_copies binds copies in their place
            state.params = [dict(stage.named_parameters(remove_duplicate=False))
                            for stage in self.stages]
            state.updates = [0] * len(self.stages)
        with self._device_copies(), self._streams_joined():
            for tick in self.schedule:
                for k, kind, m in tick:
                    if kind == "F":
                        self._train_forward(k, m, state)
                    else:
                        self._backward(k, m, state)
            total = state.total_loss
        assert total is not None
        return total / self.microbatches if self.weight_stashing else total

    # ------------------------------------------------------------ internals

    def _device(self, k: int) -> torch.device | None:
        return None if self.devices is None else self.devices[k]

    def _on(self, k: int) -> contextlib.AbstractContextManager[Any]:
        """Run on stage k's compute stream (a no-op on the CPU)."""
        stream = self._streams[k]
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _record(self, k: int) -> Any:
        """An event on stage k's stream marking the work issued so far (CUDA only)."""
        stream = self._streams[k]
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _split(self, flat: dict[str, Any], what: str) -> list[dict[str, Any]]:
        per_name = {name: _split_tree(v, self.microbatches, f"{what} {name!r}")
                    for name, v in flat.items()}
        return [{name: chunks[m] for name, chunks in per_name.items()}
                for m in range(self.microbatches)]

    def _batch_sizes(self, values: list[dict[str, Any]]) -> list[int | None]:
        """Each micro-batch's batch size: dim 0 of its first graph-input tensor with
        dim > 0 (None without one). Checks that every replicated stage can split it."""
        sizes: list[int | None] = []
        for m, graph_inputs in enumerate(values):
            size = next((x.size(0) for x in pytree.tree_leaves(graph_inputs)
                         if isinstance(x, torch.Tensor) and x.dim() > 0), None)
            for k, r in enumerate(self.replicas):
                if r > 1 and size is None:
                    raise ValueError(
                        f"Stage {k} has {r} replicas, but no graph input is a tensor with a "
                        f"batch dimension to split among them: use replicas=1 for it."
                    )
                if r > 1 and size is not None and size < r:
                    raise ValueError(
                        f"Stage {k} has {r} replicas, more than the {size} samples of "
                        f"micro-batch {m}: pass a mini-batch of at least "
                        f"{r * self.microbatches} samples ({r} per micro-batch), or give the "
                        f"stage fewer replicas."
                    )
            sizes.append(size)
        self._warn_batch_norm()
        return sizes

    def _warn_batch_norm(self) -> None:
        """Warn about BatchNorm in training mode inside a replicated stage: each
        replica would normalize with its own chunk's statistics."""
        batch_norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
        for k, (stage, r) in enumerate(zip(self.stages, self.replicas, strict=True)):
            if r == 1:
                continue
            for name, module in stage.named_modules():
                if isinstance(module, batch_norms) and module.training:
                    warnings.warn(
                        f"Stage {k} runs on {r} replicas and its {name or 'module'!r} "
                        f"({type(module).__name__}) is in training mode: each replica "
                        f"normalizes with its own chunk's statistics, so outputs and gradients "
                        f"differ from the unsplit model's. Use replicas=1 for stage {k} or "
                        f"put the module in eval mode.",
                        stacklevel=4,
                    )
                    return

    def _check_optimizers(self,
                          optimizers: Sequence[torch.optim.Optimizer | None] | None) -> None:
        num_stages = len(self.stages)
        if not self.weight_stashing:
            if optimizers is not None:
                warnings.warn(
                    "step() got optimizers, but this runner was built with "
                    "weight_stashing=False, so they are ignored: call optimizer.step() "
                    "after step(), or build the runner with weight_stashing=True.",
                    stacklevel=3,
                )
            return
        if optimizers is None:
            raise ValueError(
                f"With weight_stashing=True every stage updates its weights after each "
                f"micro-batch: pass step(..., optimizers=[...]) with one optimizer per stage "
                f"({num_stages}), each over that stage's parameters."
            )
        if len(optimizers) != num_stages:
            raise ValueError(
                f"Got {len(optimizers)} optimizers for {num_stages} stages: with "
                f"weight_stashing pass one optimizer per stage, over that stage's parameters."
            )
        for k, opt in enumerate(optimizers):
            trainable = [name for name, p in self.stages[k].named_parameters() if p.requires_grad]
            if opt is None and trainable:
                raise ValueError(
                    f"optimizers[{k}] is None, but stage {k} has trainable parameters "
                    f"({trainable[0]!r}, ...): pass an optimizer over stages[{k}].parameters()."
                )
            if opt is None:
                continue
            if not isinstance(opt, torch.optim.Optimizer):
                raise ValueError(
                    f"optimizers[{k}] is a {type(opt).__name__}, not a torch.optim.Optimizer."
                )
            own = {id(param) for param in self.stages[k].parameters()}
            for group in opt.param_groups:
                for param in group["params"]:
                    if id(param) not in own:
                        raise ValueError(
                            f"optimizers[{k}] updates {self._param_name(param)}, which is not "
                            f"a parameter of stage {k}: give each stage an optimizer over "
                            f"its own parameters (stages[{k}].parameters())."
                        )

    def _param_name(self, param: torch.Tensor) -> str:
        for k, stage in enumerate(self.stages):
            for name, p in stage.named_parameters(remove_duplicate=False):
                if p is param:
                    return f"parameter {name!r} of stage {k}"
        return f"a parameter of shape {tuple(param.shape)} in no stage"

    def _receive(self, value: Any, producer: int, k: int, event: Any, grad: bool) -> Any:
        """``value`` (made by ``producer``, -1 for a graph input) as stage k sees it:
        on k's device, ordered after ``event``; stage outputs become detached leaves
        with the producer's requires_grad when ``grad`` (a recomputed producer ran
        under no_grad, so every floating-point leaf of it may need a gradient)."""
        leaves, spec = pytree.tree_flatten(value)
        if not any(isinstance(x, torch.Tensor) for x in leaves):
            return value
        dev = self._device(k)
        out = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if producer != _GRAPH_INPUT:
                    x = self._move(x, producer, k, event)
                    if grad:
                        needs_grad = x.requires_grad or (
                            self.recompute[producer] and (x.is_floating_point() or x.is_complex())
                        )
                        x = x.detach().requires_grad_(needs_grad)
                elif dev is not None and x.device != dev:
                    x = x.to(dev)  # a graph input: differentiable, on k's stream
            out.append(x)
        return pytree.tree_unflatten(out, spec)

    def _move(self, x: torch.Tensor, producer: int, k: int, event: Any) -> torch.Tensor:
        """``x``, produced on ``producer``'s stream, made safe to use on stage k's."""
        dev, stream = self._device(k), self._streams[k]
        if dev is None or stream is None:
            if dev is None or x.device == dev:
                return x
            if event is not None and x.device.type == "cuda":  # e.g. to a CPU stage
                torch.cuda.current_stream(x.device).wait_event(event)
            return x.to(dev)
        if x.device == dev:
            if event is not None:
                stream.wait_event(event)
            x.record_stream(stream)
            return x
        y, copied = self._copy_to(x, dev, event, stream)
        stream.wait_event(copied)
        return y

    def _copy_to(self, x: torch.Tensor, dev: torch.device, event: Any,
                 consumer: Any) -> tuple[torch.Tensor, Any]:
        """Copy ``x`` to ``dev`` on dev's copy stream after ``event``; return the
        copy and the event the ``consumer`` stream must wait for before using it.
        A cross-device copy runs on the current stream of the source device too,
        hence a send stream there."""
        copy_stream = self._copy_streams[dev]
        src_streams: list[Any] = []
        if x.device.type == "cuda":
            src_streams.append(self._send_stream(x.device))
        with contextlib.ExitStack() as stack:
            for s in [*src_streams, copy_stream]:
                if event is not None:
                    s.wait_event(event)
                stack.enter_context(torch.cuda.stream(s))
            y = x.to(dev, non_blocking=True)
            for s in src_streams:
                x.record_stream(s)
            done = torch.cuda.Event()
            done.record(copy_stream)
        y.record_stream(consumer)
        return y, done

    def _send_stream(self, dev: torch.device) -> Any:
        if dev not in self._send_streams:
            self._send_streams[dev] = torch.cuda.Stream(dev)
        return self._send_streams[dev]

    def _get(self, values: Mapping[str, Any], name: str, k: int, grad: bool,
             events: Mapping[int, Any]) -> Any:
        """The value ``name`` as stage k receives it."""
        if name not in values:
            raise KeyError(
                f"Stage {k} reads {name!r}, which no earlier stage produced and "
                f"flatten_inputs did not return (it has {sorted(values)})."
            )
        p = self._producer.get(name, _GRAPH_INPUT)
        if p == k:
            return values[name]  # the last stage's own outputs, read by the loss
        return self._receive(values[name], p, k, events.get(p), grad)

    def _lazy(self, values: Mapping[str, Any], k: int, grad: bool,
              events: Mapping[int, Any]) -> "_OnDemand":
        """A dict for ``build_output`` that receives a value on stage k's device
        only when it is read (so unread activations never move)."""
        return _OnDemand(values, lambda name: self._get(values, name, k, grad, events))

    def _run_stage(self, k: int, inputs: dict[str, Any], batch: int | None,
                   stash: Stash | None) -> tuple[Any, ...]:
        """Stage k on one micro-batch of ``batch`` samples: whole, or split along
        dim 0 among its replicas and concatenated back (see the module docstring)."""
        r = self.replicas[k]
        if r == 1:
            return self._run_replica(k, 0, inputs, stash)
        assert batch is not None and batch >= r, (k, batch, r)  # checked by _batch_sizes
        chunks = _split_replicas(inputs, batch, r)
        outputs = [self._run_replica(k, i, chunk, stash) for i, chunk in enumerate(chunks)]
        return tuple(_merge_replicas(outputs, _chunk_sizes(batch, r)))

    def _run_replica(self, k: int, i: int, inputs: dict[str, Any],
                     stash: Stash | None) -> tuple[Any, ...]:
        """Replica i of stage k on its inputs: the module itself, or with the
        stashed Parameters and/or the copies bound on replica i's device."""
        stage = self.stages[k]
        bound = self._bound.get((k, i))
        if bound is None:
            params = stash
        else:  # replica i on another device than the stage's: inputs and weights go there
            dev = self.replica_devices[k][i] if self.replica_devices is not None else None
            inputs = _to_device(inputs, dev)
            params = bound if stash is None else {
                **bound, **{name: t.to(dev) for name, t in stash.items()}
            }
        if params is None:
            outputs = stage(**inputs)
        else:
            outputs = torch.func.functional_call(stage, params, (), inputs)
        if not isinstance(outputs, tuple) or len(outputs) != len(self._outputs[k]):
            got = f"a tuple of {len(outputs)}" if isinstance(outputs, tuple) else type(outputs)
            raise TypeError(
                f"Stage {k} returned {got}, expected a tuple of its {len(self._outputs[k])} "
                f"OUTPUTS {self._outputs[k]}."
            )
        if bound is not None:
            outputs = _to_device(outputs, self._device(k))
        return outputs

    def _forward(self, k: int, values: dict[str, Any], grad: bool, events: dict[int, Any],
                 batch: int | None, stash: Stash | None = None) -> tuple[dict[str, Any], Any]:
        """Stage k's forward on one micro-batch's ``values``; records its event."""
        with self._on(k):
            inputs = {name: self._get(values, name, k, grad, events) for name in self._inputs[k]}
            outputs = self._run_stage(k, inputs, batch, stash)
            values.update(zip(self._outputs[k], outputs, strict=True))
        events[k] = self._record(k)
        return inputs, outputs

    def _train_forward(self, k: int, m: int, state: "_StepState") -> None:
        values = state.values[m]
        events = state.fwd_events[m]
        stash = self._stash(k, state) if self.weight_stashing else None
        if self.recompute[k]:
            rng = self._rng_state(k)
            with torch.no_grad():
                inputs, _ = self._forward(k, values, True, events, state.batch[m], stash)
            state.saved[(k, m)] = (inputs, None, rng, stash)
        else:
            inputs, outputs = self._forward(k, values, True, events, state.batch[m], stash)
            state.saved[(k, m)] = (inputs, outputs, None, stash)
        if k == len(self.stages) - 1 and not self.recompute[k]:
            state.losses[m] = self._loss(k, m, state)

    def _stash(self, k: int, state: "_StepState") -> Stash:
        """Stage k's Parameters that require grad, as detached copies of their current
        version on k's device (shared by the micro-batches that start on this version)."""
        version = state.updates[k]
        cached = state.stashes.get(k)
        if cached is not None and cached[0] == version:
            return cached[1]
        dev = self._device(k)
        copies: dict[int, torch.Tensor] = {}  # id(Parameter) -> its copy, one for all its names
        with self._on(k):
            for p in state.params[k].values():
                if p.requires_grad and id(p) not in copies:
                    copies[id(p)] = p.detach().to(dev or p.device, copy=True).requires_grad_()
        stash = {name: copies[id(p)] for name, p in state.params[k].items() if id(p) in copies}
        state.stashes[k] = (version, stash)
        return stash

    def _update(self, k: int, stash: Stash, state: "_StepState") -> None:
        """After B(k, m): the stash's gradients become the live Parameters' ``.grad``
        (replacing it), stage k's optimizer steps and zeroes them (weight stashing)."""
        moved: set[int] = set()
        for name, copy in stash.items():
            if id(copy) in moved:
                continue  # another name of the same Parameter
            moved.add(id(copy))
            param = state.params[k][name]
            g, copy.grad = copy.grad, None  # the stash may serve a later micro-batch too
            param.grad = None if g is None else g.to(param.device)
        optimizer = state.optimizers[k]
        if optimizer is not None:  # None: the stage has nothing to train
            optimizer.step()
            optimizer.zero_grad()
        state.updates[k] += 1
        state.stashes.pop(k, None)  # the next F(k, .) copies the new version

    def _loss(self, k: int, m: int, state: "_StepState") -> tuple[torch.Tensor, dict[str, Any]]:
        """loss_fn(build_output(values of m), target of m) / M on the last stage (not
        divided with weight stashing); returns it with the values build_output read
        (leaves for earlier stages')."""
        values = state.values[m]
        with self._on(k):
            out_in = self._lazy(values, k, True, state.fwd_events[m])
            target = state.targets[m]
            dev = self._device(k)
            if dev is not None:
                target = pytree.tree_map(
                    lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, target
                )
            loss = state.loss_fn(self.build_output(out_in), target)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(f"loss_fn must return a scalar tensor, got {loss!r}.")
            if not self.weight_stashing:  # with it every micro-batch is its own update
                loss = loss / self.microbatches
            total = loss.detach()
            state.total_loss = total if state.total_loss is None else state.total_loss + total
        return loss, out_in

    def _backward(self, k: int, m: int, state: "_StepState") -> None:
        inputs, outputs, rng, stash = state.saved.pop((k, m))
        values = state.values[m]
        last = len(self.stages) - 1
        with self._on(k):
            if self.recompute[k]:
                with torch.enable_grad(), self._rng_restored(k, rng):
                    outputs = self._run_stage(k, inputs, state.batch[m], stash)
                values.update(zip(self._outputs[k], outputs, strict=True))
            tensors: list[torch.Tensor] = []
            grads: list[torch.Tensor | None] = []
            loss_inputs: dict[str, Any] = {}
            if k == last:
                if self.recompute[k]:
                    with torch.enable_grad():
                        state.losses[m] = self._loss(k, m, state)
                loss, loss_inputs = state.losses.pop(m)
                tensors.append(loss)
                grads.append(None)
            for name, out in zip(self._outputs[k], outputs, strict=True):
                contributions = state.grads[m].pop(name, [])
                for event in (e for _g, e in contributions if e is not None):
                    self._streams[k].wait_event(event)
                summed = _sum_grads([g for g, _e in contributions])
                if summed is None:
                    continue
                for t, g in zip(pytree.tree_leaves(out), summed, strict=True):
                    if isinstance(t, torch.Tensor) and t.requires_grad and g is not None:
                        tensors.append(t)
                        grads.append(g)
            if tensors:
                torch.autograd.backward(tensors, grads)
            done = self._record(k)
            received = [*inputs.items(), *dict.items(loss_inputs)]
            for name, leaf_value in received:
                p = self._producer.get(name, _GRAPH_INPUT)
                if p in (_GRAPH_INPUT, k):
                    continue
                leaf_grads = [x.grad if isinstance(x, torch.Tensor) else None
                              for x in pytree.tree_leaves(leaf_value)]
                if all(g is None for g in leaf_grads):
                    continue
                state.grads[m].setdefault(name, []).append(
                    self._send_grads(leaf_grads, k, p, done)
                )
            if stash is not None:
                self._update(k, stash, state)
        for name in self._outputs[k]:  # no later stage reads them any more
            values.pop(name, None)
        state.fwd_events[m].pop(k, None)

    def _send_grads(self, leaf_grads: list[torch.Tensor | None], k: int, p: int,
                    done: Any) -> tuple[list[torch.Tensor | None], Any]:
        """Gradients computed on stage k for a value of stage p, on p's device,
        with the event p's stream must wait for before using them."""
        dev_p, stream_p = self._device(p), self._streams[p]
        if dev_p is None or stream_p is None:
            moved = [g if g is None or dev_p is None else g.to(dev_p) for g in leaf_grads]
            return moved, None
        out: list[torch.Tensor | None] = []
        for g in leaf_grads:
            if g is None:
                out.append(None)
            elif g.device == dev_p:
                g.record_stream(stream_p)
                out.append(g)
            else:
                y, copied = self._copy_to(g, dev_p, done, stream_p)
                out.append(y)
                done = copied  # ordered after the backward's event
        return out, done

    def _rng_state(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        dev = self._device(k)
        cuda_state = None
        if dev is not None and dev.type == "cuda":
            cuda_state = torch.cuda.get_rng_state(dev)
        return torch.get_rng_state(), cuda_state

    @contextlib.contextmanager
    def _rng_restored(self, k: int, rng: Any) -> Iterator[None]:
        """Replay stage k's forward with the random state it first ran with (dropout)."""
        dev = self._device(k)
        cuda_devices = [dev] if dev is not None and dev.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_devices):
            cpu_state, cuda_state = rng
            torch.set_rng_state(cpu_state)
            if cuda_state is not None and dev is not None:
                torch.cuda.set_rng_state(cuda_state, dev)
            yield

    @contextlib.contextmanager
    def _streams_joined(self) -> Iterator[None]:
        """Stage streams start after the caller's work and the caller's streams
        continue after the stages' (CUDA only; no device synchronize)."""
        pairs = [(dev, s) for dev, s in zip(self.devices or [], self._streams, strict=False)
                 if s is not None]
        for dev, s in pairs:
            s.wait_stream(torch.cuda.current_stream(dev))
        try:
            yield
        finally:
            for dev, s in pairs:
                torch.cuda.current_stream(dev).wait_stream(s)
                for c in (self._copy_streams[dev], self._send_streams[dev]):
                    torch.cuda.current_stream(dev).wait_stream(c)

    @contextlib.contextmanager
    def _device_copies(self) -> Iterator[None]:
        """Bind a copy of every Parameter or buffer that lives on another device
        than its stage, and collect copies on the device of every replica that runs
        elsewhere than its stage (``_bound``); afterwards add the copies' gradients
        into the originals."""
        if self.devices is None or self.replica_devices is None:
            yield
            return
        swapped: list[tuple[nn.Module, str, Any, bool]] = []
        copies: dict[tuple[int, torch.device], Any] = {}
        grads_back: list[tuple[torch.Tensor, nn.Parameter]] = []

        def copy_on(t: torch.Tensor, dev: torch.device, is_param: bool) -> Any:
            """``t`` on ``dev``: itself, or one copy shared by every stage binding it."""
            if t.device == dev:
                return t
            key = (id(t), dev)
            if key not in copies:
                data = t.detach().to(dev, copy=True)
                if is_param:
                    replica = nn.Parameter(data, requires_grad=t.requires_grad)
                    grads_back.append((t, replica))
                    copies[key] = replica
                else:
                    copies[key] = data
            return copies[key]

        for k, stage in enumerate(self.stages):
            dev = self.devices[k]
            for i, dev_i in enumerate(self.replica_devices[k]):
                if dev_i != dev:  # before the swap below: copies of the originals
                    params = stage.named_parameters(remove_duplicate=False)
                    buffers = stage.named_buffers(remove_duplicate=False)
                    self._bound[(k, i)] = {
                        **{name: copy_on(t, dev_i, True) for name, t in params},
                        **{name: copy_on(t, dev_i, False) for name, t in buffers},
                    }
            for module in stage.modules():
                for is_param, table in ((True, module._parameters), (False, module._buffers)):
                    for name, t in list(table.items()):
                        if t is None or t.device == dev:
                            continue
                        swapped.append((module, name, t, is_param))
                        table[name] = copy_on(t, dev, is_param)
        try:
            yield
        finally:
            self._bound.clear()
            # newest first: a module shared by two stages may hold a copy of a copy
            for module, name, original, is_param in reversed(swapped):
                (module._parameters if is_param else module._buffers)[name] = original
            for original, replica in reversed(grads_back):
                if replica.grad is None:
                    continue
                g = replica.grad.to(original.device)
                if original.grad is None:
                    original.grad = g
                else:
                    original.grad.add_(g)


class _OnDemand(dict[str, Any]):
    """A dict whose entries are fetched from ``source`` by ``fetch`` on first read
    (``d[name]``, ``d.get(name)``, ``name in d``); iterating it shows only the
    entries read so far."""

    def __init__(self, source: Mapping[str, Any], fetch: Callable[[str], Any]) -> None:
        super().__init__()
        self._source = source
        self._fetch = fetch

    def __missing__(self, name: str) -> Any:
        value = self._fetch(name)
        self[name] = value
        return value

    def __contains__(self, name: object) -> bool:
        return name in self._source

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self._source else default


class _StepState:
    """Everything one ``step`` keeps per micro-batch."""

    def __init__(self, values: list[dict[str, Any]], targets: list[Any],
                 loss_fn: Callable[[Any, Any], torch.Tensor], batch: list[int | None]) -> None:
        num_mb = len(values)
        self.values = values  # m -> name -> value
        self.targets = targets
        self.loss_fn = loss_fn
        self.batch = batch  # m -> batch size (split among a replicated stage's replicas)
        # m -> name -> [(per-leaf grads from one consumer, event to wait for)]
        self.grads: list[dict[str, list[tuple[list[torch.Tensor | None], Any]]]] = [
            {} for _ in range(num_mb)
        ]
        self.fwd_events: list[dict[int, Any]] = [{} for _ in range(num_mb)]  # m -> k -> event
        # (k, m) -> (input leaves, outputs or None when recomputed, RNG state or None,
        #            the stashed weights F(k, m) used or None)
        self.saved: dict[tuple[int, int], tuple[dict[str, Any], Any, Any, Stash | None]] = {}
        self.losses: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        self.total_loss: torch.Tensor | None = None
        # weight stashing: k -> its optimizer, its live Parameters by name, the number of
        # updates so far (its weights' version), and (version, copy) of the newest stash
        self.optimizers: list[torch.optim.Optimizer | None] = []
        self.params: list[dict[str, nn.Parameter]] = []
        self.updates: list[int] = []
        self.stashes: dict[int, tuple[int, Stash]] = {}


def _as_device(d: torch.device | str | int) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    dev = torch.device(d)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _replica_devices(k: int, device: Device | Sequence[Device],
                     replicas: int) -> list[torch.device]:
    """Stage k's devices, one per replica: ``device`` for all of them, or a sequence
    of ``replicas`` devices."""
    if isinstance(device, torch.device | str | int):
        return [_as_device(device)] * replicas
    devices = [_as_device(d) for d in device]
    if len(devices) != replicas:
        raise ValueError(
            f"Stage {k} has {replicas} replicas but devices[{k}] lists {len(devices)} devices: "
            f"pass one device per replica, or a single device to run them all on."
        )
    return devices


def _check_unshared(stages: list[nn.Module]) -> None:
    """With weight stashing each stage updates its own weights: no Parameter may be
    bound into two stages."""
    owner: dict[int, tuple[int, str]] = {}
    for k, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            first = owner.setdefault(id(param), (k, name))
            if first[0] != k:
                raise ValueError(
                    f"Parameter {first[1]!r} of stage {first[0]} is also bound into stage {k} "
                    f"(as {name!r}): with weight_stashing each stage updates its own weights "
                    f"after every micro-batch, so a parameter can belong to one stage only; "
                    f"untie it or keep its uses on one stage."
                )


def _check_schedule(schedule: list[tuple[Action, ...]], num_stages: int, num_mb: int) -> None:
    """Raise ValueError unless the schedule runs each (stage, F/B, m) once, in
    dependency order (F(j, m) after F(j-1, m); B(j, m) after F(j, m) and B(j+1, m))."""
    done: set[Action] = set()
    for t, tick in enumerate(schedule):
        for action in tick:
            j, kind, m = action
            if not (0 <= j < num_stages and kind in ("F", "B") and 0 <= m < num_mb):
                raise ValueError(
                    f"Schedule tick {t} has {action}, outside {num_stages} stages x "
                    f"{num_mb} micro-batches: regenerate the schedule for this runner."
                )
            if action in done:
                raise ValueError(f"Schedule runs {action} twice (again in tick {t}).")
            deps = [(j - 1, "F", m)] if kind == "F" and j > 0 else []
            if kind == "B":
                deps = [(j, "F", m)] + ([(j + 1, "B", m)] if j + 1 < num_stages else [])
            missing = [d for d in deps if d not in done]
            if missing:
                raise ValueError(f"Schedule tick {t} runs {action} before {missing}.")
        done.update(tick)
    expected = num_stages * num_mb * 2
    if len(done) != expected:
        raise ValueError(
            f"Schedule has {len(done)} actions, expected {expected} "
            f"({num_stages} stages x {num_mb} micro-batches x forward and backward)."
        )


def _split_tree(value: Any, num_mb: int, what: str) -> list[Any]:
    """Split every tensor leaf of ``value`` along dim 0 into ``num_mb`` chunks;
    0-dim tensors and non-tensors are passed to every micro-batch unchanged."""
    for x in pytree.tree_leaves(value):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.size(0) < num_mb:
                raise ValueError(
                    f"The {what} has batch size {x.size(0)}, fewer than the {num_mb} "
                    f"micro-batches: pass a mini-batch of at least {num_mb} samples."
                )
            if x.size(0) % num_mb:
                warnings.warn(
                    f"The {what} has batch size {x.size(0)}, not a multiple of {num_mb} "
                    f"micro-batches: micro-batches differ in size, and a batch-mean loss "
                    f"no longer equals the unsplit model's.",
                    stacklevel=3,
                )
    return _split_leaves(value, num_mb, lambda x: x.dim() > 0)


def _split_leaves(value: Any, n: int, splits: Callable[[torch.Tensor], bool]) -> list[Any]:
    """``n`` trees shaped like ``value``: the tensor leaves ``splits`` accepts cut along
    dim 0 into n chunks (``torch.tensor_split``), every other leaf whole in each."""
    leaves, spec = pytree.tree_flatten(value)
    columns = [torch.tensor_split(x, n, dim=0) if isinstance(x, torch.Tensor) and splits(x)
               else [x] * n for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(n)]


def _merge_leaves(trees: list[Any], merge: Callable[[list[Any]], Any]) -> Any:
    """One tree from ``trees`` of one structure: each leaf is ``merge`` of that leaf's
    values in every tree, in order."""
    flat = [pytree.tree_flatten(tree) for tree in trees]
    leaves0, spec = flat[0]
    return pytree.tree_unflatten(
        [merge([leaves[i] for leaves, _ in flat]) for i in range(len(leaves0))], spec)


def _chunk_sizes(batch: int, r: int) -> list[int]:
    """The sizes ``torch.tensor_split`` gives ``batch`` samples split ``r`` ways."""
    q, rest = divmod(batch, r)
    return [q + 1 if i < rest else q for i in range(r)]


def _split_replicas(inputs: dict[str, Any], batch: int, r: int) -> list[dict[str, Any]]:
    """One input dict per replica: tensor leaves with dim 0 == ``batch`` split into r
    chunks along dim 0, every other leaf passed whole to each replica."""
    return _split_leaves(inputs, r, lambda x: x.dim() > 0 and x.size(0) == batch)


def _merge_replicas(outputs: list[tuple[Any, ...]], sizes: list[int]) -> Any:
    """The replicas' outputs as one: a tensor leaf whose dim 0 is each replica's
    chunk size is concatenated along dim 0, any other leaf taken from replica 0."""

    def merge(parts: list[Any]) -> Any:
        batched = all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.size(0) == size
                      for t, size in zip(parts, sizes, strict=True))
        return torch.cat(parts, dim=0) if batched else parts[0]

    return _merge_leaves(outputs, merge)


def _to_device(value: Any, dev: torch.device | None) -> Any:
    """``value`` with its tensor leaves copied to ``dev`` (differentiably)."""
    if dev is None:
        return value
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dev), value)


def _sum_grads(contributions: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None] | None:
    """Per-leaf sum of the gradients each consumer sent for one value."""
    if not contributions:
        return None
    total = list(contributions[0])
    for grads in contributions[1:]:
        for i, g in enumerate(grads):
            if g is not None:
                acc = total[i]
                total[i] = g if acc is None else acc + g
    return total


def _concat(outputs: list[Any]) -> Any:
    """Rebuild one output from per-micro-batch outputs: tensor leaves are
    concatenated along dim 0 (0-dim tensors stacked), other leaves taken from
    micro-batch 0."""

    def merge(parts: list[Any]) -> Any:
        if not isinstance(parts[0], torch.Tensor):
            return parts[0]
        return torch.cat(parts, dim=0) if parts[0].dim() > 0 else torch.stack(parts)

    return _merge_leaves(outputs, merge)
