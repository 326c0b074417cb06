"""Run pipeline stage modules on a clock-tick schedule.

This module is copied verbatim into every generated ``runner.py`` after a
header that defines ``SCHEDULE``, ``MICROBATCHES``, ``RECOMPUTE``,
``GRAPH_INPUTS``, ``flatten_inputs`` and ``build_output``; it imports only
torch and the standard library.

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
_GRAPH_INPUT = -1  # producer index of a value that comes from the caller


class PipelineRunner:
    """Execute ``stages`` (modules with ``INPUTS``/``OUTPUTS`` name tuples whose
    forward takes inputs by name and returns a tuple in ``OUTPUTS`` order) on a
    clock-tick ``schedule`` of ``microbatches`` micro-batches."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[torch.device | str | int] | None = None,
        *,
        schedule: Sequence[Sequence[Action]],
        microbatches: int,
        flatten_inputs: Callable[..., dict[str, Any]],
        build_output: Callable[[dict[str, Any]], Any],
        recompute: Sequence[bool] | None = None,
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
        self.stages = list(stages)
        self.schedule = [tuple((int(j), str(kind), int(m)) for j, kind, m in tick)
                         for tick in schedule]
        self.microbatches = microbatches
        self.flatten_inputs = flatten_inputs
        self.build_output = build_output
        self.recompute = [bool(r) for r in recompute]
        _check_schedule(self.schedule, num_stages, microbatches)

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

        self.devices: list[torch.device] | None = None
        self._streams: list[Any] = [None] * num_stages
        self._copy_streams: dict[torch.device, Any] = {}
        self._send_streams: dict[torch.device, Any] = {}
        if devices is not None:
            self.devices = [_as_device(d) for d in devices]
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
        last = len(self.stages) - 1
        events: list[dict[int, Any]] = [{} for _ in range(self.microbatches)]
        outputs = []
        with torch.no_grad(), self._replicas(), self._streams_joined():
            for tick in self.schedule:
                for k, kind, m in tick:
                    if kind == "F":
                        self._forward(k, values[m], grad=False, events=events[m])
            for m in range(self.microbatches):
                with self._on(last):
                    outputs.append(self.build_output(self._lazy(values[m], last, False, events[m])))
                values[m] = {}
            with self._on(last):
                return _concat(outputs)

    __call__ = forward

    def step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Any:
        """Forward and backward of the mini-batch ``inputs`` (a tuple of positional
        arguments or a dict of keyword arguments) against ``target``; gradients
        accumulate into the stages' parameters. Returns the mean loss, detached."""
        if isinstance(inputs, Mapping):
            flat = self.flatten_inputs(**inputs)
        elif isinstance(inputs, tuple | list):
            flat = self.flatten_inputs(*inputs)
        else:
            flat = self.flatten_inputs(inputs)
        state = _StepState(
            values=self._split(flat, "input"),
            targets=_split_tree(target, self.microbatches, "target"),
            loss_fn=loss_fn,
        )
        with self._replicas(), self._streams_joined():
            for tick in self.schedule:
                for k, kind, m in tick:
                    if kind == "F":
                        self._train_forward(k, m, state)
                    else:
                        self._backward(k, m, state)
            total = state.total_loss
        assert total is not None
        return total

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

    def _run_stage(self, k: int, inputs: dict[str, Any]) -> tuple[Any, ...]:
        outputs = self.stages[k](**inputs)
        if not isinstance(outputs, tuple) or len(outputs) != len(self._outputs[k]):
            got = f"a tuple of {len(outputs)}" if isinstance(outputs, tuple) else type(outputs)
            raise TypeError(
                f"Stage {k} returned {got}, expected a tuple of its {len(self._outputs[k])} "
                f"OUTPUTS {self._outputs[k]}."
            )
        return outputs

    def _forward(self, k: int, values: dict[str, Any], grad: bool,
                 events: dict[int, Any]) -> tuple[dict[str, Any], Any]:
        """Stage k's forward on one micro-batch's ``values``; records its event."""
        with self._on(k):
            inputs = {name: self._get(values, name, k, grad, events) for name in self._inputs[k]}
            outputs = self._run_stage(k, inputs)
            values.update(zip(self._outputs[k], outputs, strict=True))
        events[k] = self._record(k)
        return inputs, outputs

    def _train_forward(self, k: int, m: int, state: "_StepState") -> None:
        values = state.values[m]
        events = state.fwd_events[m]
        if self.recompute[k]:
            rng = self._rng_state(k)
            with torch.no_grad():
                inputs, _ = self._forward(k, values, grad=True, events=events)
            state.saved[(k, m)] = (inputs, None, rng)
        else:
            inputs, outputs = self._forward(k, values, grad=True, events=events)
            state.saved[(k, m)] = (inputs, outputs, None)
        if k == len(self.stages) - 1 and not self.recompute[k]:
            state.losses[m] = self._loss(k, m, state)

    def _loss(self, k: int, m: int, state: "_StepState") -> tuple[torch.Tensor, dict[str, Any]]:
        """loss_fn(build_output(values of m), target of m) / M on the last stage;
        returns it with the values build_output read (leaves for earlier stages')."""
        values = state.values[m]
        with self._on(k):
            out_in = self._lazy(values, k, True, state.fwd_events[m])
            target = state.targets[m]
            dev = self._device(k)
            if dev is not None:
                target = pytree.tree_map(
                    lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, target
                )
            loss = state.loss_fn(self.build_output(out_in), target) / self.microbatches
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(f"loss_fn must return a scalar tensor, got {loss!r}.")
            total = loss.detach()
            state.total_loss = total if state.total_loss is None else state.total_loss + total
        return loss, out_in

    def _backward(self, k: int, m: int, state: "_StepState") -> None:
        inputs, outputs, rng = state.saved.pop((k, m))
        values = state.values[m]
        last = len(self.stages) - 1
        with self._on(k):
            if self.recompute[k]:
                with torch.enable_grad(), self._rng_restored(k, rng):
                    outputs = self._run_stage(k, inputs)
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
    def _replicas(self) -> Iterator[None]:
        """Bind a copy of every Parameter or buffer that lives on another device
        than its stage; afterwards add the copies' gradients into the originals."""
        if self.devices is None:
            yield
            return
        swapped: list[tuple[nn.Module, str, Any, bool]] = []
        copies: dict[tuple[int, torch.device], Any] = {}
        grads_back: list[tuple[torch.Tensor, nn.Parameter]] = []
        for stage, dev in zip(self.stages, self.devices, strict=True):
            for module in stage.modules():
                for is_param, table in ((True, module._parameters), (False, module._buffers)):
                    for name, t in list(table.items()):
                        if t is None or t.device == dev:
                            continue
                        key = (id(t), dev)
                        if key not in copies:
                            data = t.detach().to(dev, copy=True)
                            if is_param:
                                replica = nn.Parameter(data, requires_grad=t.requires_grad)
                                grads_back.append((t, replica))
                                copies[key] = replica
                            else:
                                copies[key] = data
                        swapped.append((module, name, t, is_param))
                        table[name] = copies[key]
        try:
            yield
        finally:
            for module, name, original, is_param in swapped:
                (module._parameters if is_param else module._buffers)[name] = original
            for original, replica in grads_back:
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
                 loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        num_mb = len(values)
        self.values = values  # m -> name -> value
        self.targets = targets
        self.loss_fn = loss_fn
        # m -> name -> [(per-leaf grads from one consumer, event to wait for)]
        self.grads: list[dict[str, list[tuple[list[torch.Tensor | None], Any]]]] = [
            {} for _ in range(num_mb)
        ]
        self.fwd_events: list[dict[int, Any]] = [{} for _ in range(num_mb)]  # m -> k -> event
        # (k, m) -> (input leaves, outputs or None when recomputed, RNG state or None)
        self.saved: dict[tuple[int, int], tuple[dict[str, Any], Any, Any]] = {}
        self.losses: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        self.total_loss: torch.Tensor | None = None


def _as_device(d: torch.device | str | int) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    dev = torch.device(d)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


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
    leaves, spec = pytree.tree_flatten(value)
    chunks: list[list[Any]] = []
    for x in leaves:
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
            chunks.append(list(torch.tensor_split(x, num_mb, dim=0)))
        else:
            chunks.append([x] * num_mb)
    return [pytree.tree_unflatten([c[m] for c in chunks], spec) for m in range(num_mb)]


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
    flat = [pytree.tree_flatten(o) for o in outputs]
    leaves0, spec = flat[0]
    merged = []
    for i, x in enumerate(leaves0):
        if isinstance(x, torch.Tensor):
            parts = [leaves[i] for leaves, _ in flat]
            merged.append(torch.cat(parts, dim=0) if x.dim() > 0 else torch.stack(parts))
        else:
            merged.append(x)
    return pytree.tree_unflatten(merged, spec)
