"""Run pipeline stage modules on a clock-tick schedule, in one process.

# K: stages, M: micro-batches, j/k: a stage, m: a micro-batch.

The schedule (see schedule.py) is a list of ticks of ``(stage, "F" | "B", m)``
actions (I and W: a split B, split_backward.py), run in order. Values move between
stages as values.py draws, across devices as stream.py; replicas.py, placement.py and
stashing.py hold replicated stages, tied parameters and weight stashing.

On the CPU (``devices=None``) the ticks run in order on one thread. On CUDA
every stage runs on its device on its own compute stream.

``step`` accumulates into ``.grad`` exactly as ``loss.backward()`` would: call
``optimizer.zero_grad()`` before it. Gradients equal the unsplit model's over
the mini-batch when ``loss_fn`` is a mean over the samples: each micro-batch's
loss is weighted by its share of the samples, so a mini-batch that is not a
multiple of M (split as evenly as ``torch.tensor_split`` does) or has fewer
than M samples (run as that many micro-batches, the schedule's actions for
the missing ones skipped) gives the same gradients. ``precision`` (see
mixed_precision.py) runs every stage forward, and the loss, under the plan's autocast;
for ``16-mixed`` the loss is scaled by ``runner.scaler`` before backward, so call
``runner.scaler.step(optimizer)`` and ``runner.scaler.update()`` instead of
``optimizer.step()``.

Both refuse, before anything runs, a call the model would refuse for its arguments
(calls.py) or its batch: batched inputs, and a target, of different rows (microbatch.py).
Graph inputs the model writes in place are written back into the caller's tensors.
"""

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import recompute as remat
from .calls import graph_inputs, step_arguments
from .input_dims import as_passed
from .measure import MeasuredSteps, timed
from .microbatch import (
    check_rows,
    chunk_sizes,
    concat,
    own_copies,
    sample_share,
    split_inputs,
    split_microbatches,
    split_replicas,
    write_back,
    written_back,
)
from .mixed_precision import as_activations, autocast, check_precision, grad_scaler, warn_uncast
from .placement import DeviceSpec, device_copies, replica_devices, to_device
from .replicas import batch_sizes, check_replicas, merge_replicas
from .schedule import Action, check_schedule, check_sizes
from .split_backward import check_split, input_backward, weight_backward
from .stashing import Stash, WeightStashes, check_optimizers, check_stashing
from .stream import Streams
from .values import GRAPH_INPUT, OnDemand, StepState, Wiring, receive, received_grads, sum_grads

__all__ = ["PipelineRunner"]


class PipelineRunner(MeasuredSteps):
    """Execute ``stages`` (modules with ``INPUTS``/``OUTPUTS`` name tuples whose forward
    takes inputs by name and returns a tuple in ``OUTPUTS`` order) on a clock-tick
    ``schedule`` of ``microbatches`` micro-batches.

    ``replicas[k]`` (default 1) runs stage k data-parallel on that many chunks of every
    micro-batch, and ``devices[k]`` may then list one device per replica; ``weight_stashing``
    makes ``step`` update every stage after each of its backwards with the optimizers it is
    given (see stashing.py); ``shared_inputs`` go whole."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[DeviceSpec | Sequence[DeviceSpec]] | None = None,
        *,
        schedule: Sequence[Sequence[Action]],
        microbatches: int,
        flatten_inputs: Callable[..., dict[str, Any]],
        build_output: Callable[[dict[str, Any]], Any],
        recompute: Sequence[str | bool] | None = None,
        replicas: Sequence[int] | None = None,
        weight_stashing: bool = False,
        precision: str = "32-true",
        shared_inputs: Collection[str] = (),
    ) -> None:
        num_stages = len(stages)
        check_sizes(num_stages, microbatches, devices)
        recompute_modes = remat.modes(recompute, num_stages)
        replicas = [1] * num_stages if replicas is None else replicas
        check_replicas(replicas, num_stages)
        self.stages = list(stages)
        self.schedule = [tuple((int(j), str(kind), int(m)) for j, kind, m in tick)
                         for tick in schedule]
        self.microbatches = microbatches
        self.flatten_inputs = flatten_inputs
        self.build_output = build_output
        # per stage (recompute.MODES): "full" keeps its inputs only and runs its forward again
        # in the backward; "selective" also the matmuls' and attention's outputs its rule keeps
        self.recompute = [mode == "full" for mode in recompute_modes]
        self.selective = [remat.keep_rule(mode) for mode in recompute_modes]  # None: not
        self.replicas = [int(r) for r in replicas]
        self.weight_stashing = bool(weight_stashing)
        self.precision = check_precision(precision)
        scaled = grad_scaler(self.precision, None) is not None
        check_stashing(self.stages, self.weight_stashing, scaled=scaled)
        warn_uncast(self.stages, self.precision)
        self.shared_inputs = frozenset(shared_inputs)
        check_schedule(self.schedule, num_stages, microbatches)
        check_split(self.schedule, self.replicas, self.weight_stashing, recompute_modes)
        self.wiring = Wiring(self.stages)
        # devices[k]: stage k's own device (its replica 0's); replica_devices[k][i]: replica i's
        self.devices: list[torch.device] | None = None
        self.replica_devices: list[list[torch.device]] | None = None
        if devices is not None:
            self.replica_devices = [replica_devices(k, d, r) for k, (d, r)
                                    in enumerate(zip(devices, self.replicas, strict=True))]
            self.devices = [devs[0] for devs in self.replica_devices]
        self.streams = Streams(self.devices, num_stages)
        # 16-mixed: scales the loss before backward; the caller steps and updates it
        self.scaler = grad_scaler(self.precision, self.streams.device(num_stages - 1))
        # (k, i) -> Parameters and buffers of stage k copied to replica i's device, bound for
        # one step/forward by device_copies (absent: replica i runs on the stage's device)
        self._bound: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ API

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Inference on a mini-batch: split it into M micro-batches (fewer if it has fewer
        samples), run every stage forward under ``no_grad``, concatenate along dim 0 (what
        concatenation cannot rebuild, a 0-dim output, is refused: microbatch.concat)."""
        flat = graph_inputs(self.flatten_inputs, args, kwargs, "runner.forward")
        values = self._split(flat)
        num_mb = len(values)
        batch = batch_sizes(values, self.stages, self.replicas, self.shared_inputs)
        last = len(self.stages) - 1
        events: list[dict[int, Any]] = [{} for _ in range(num_mb)]
        outputs = []
        with torch.no_grad(), self._device_copies(), self.streams.joined(), as_passed(flat):
            for tick in self.schedule:
                for k, kind, m in tick:
                    if kind == "F" and m < num_mb:
                        self._forward(k, values[m], grad=False, events=events[m],
                                      batch=batch[m])
            for m in range(num_mb):
                with self.streams.on(last):
                    outputs.append(self.build_output(self._lazy(values[m], last, False, events[m])))
                values[m] = {n: v for n, v in values[m].items() if n in self.wiring.written}
            with self.streams.on(last):
                output = concat(outputs, batch)
        write_back(flat, values, self.wiring.written, self.shared_inputs)
        return output

    __call__ = forward

    def step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
             optimizers: Sequence[torch.optim.Optimizer | None] | None = None) -> Any:
        """Forward and backward of the mini-batch ``inputs`` (a tuple of positional
        arguments or a dict of keyword arguments) against ``target``; gradients
        accumulate into the stages' parameters. Returns the mean loss, detached.

        With ``weight_stashing``, ``optimizers`` (one per stage, over that stage's
        parameters; None for a stage without trainable parameters) update each stage
        after every micro-batch's backward instead."""
        check_optimizers(self.stages, self.weight_stashing, optimizers)
        flat = graph_inputs(self.flatten_inputs, *step_arguments(inputs), "runner.step's inputs")
        values = self._split(flat)
        num_mb = len(values)
        check_rows(target, flat, self.shared_inputs, "target")
        state = StepState(
            values=values, targets=split_microbatches(target, num_mb, "target"), loss_fn=loss_fn,
            batch=batch_sizes(values, self.stages, self.replicas, self.shared_inputs),
            # the live Parameters, before _device_copies binds copies in their place
            stashes=(WeightStashes(self.stages, optimizers or ())
                     if self.weight_stashing else None))
        with (timed(self._recorder), self._device_copies(), self.streams.joined(),
              as_passed(flat)):
            for tick in self.schedule:
                for k, kind, m in tick:
                    if m >= num_mb:
                        continue  # a mini-batch of fewer than M samples
                    with timed(self._recorder, k, kind):  # while measure() is active
                        if kind == "F":
                            self._train_forward(k, m, state)
                        elif kind == "W":
                            with self.streams.on(k):
                                weight_backward(self.stages[k], *state.deferred.pop((k, m)))
                        else:
                            self._backward(k, m, state, inputs_only=kind == "I")
            total = state.total_loss
        assert total is not None
        write_back(flat, values, self.wiring.written, self.shared_inputs)
        return total

    def _split(self, flat: dict[str, Any]) -> list[dict[str, Any]]:
        """Each micro-batch's graph inputs: M, or one per sample when there are fewer."""
        return split_inputs(flat, self.microbatches, self.shared_inputs, self.wiring.written)

    def _device_copies(self) -> contextlib.AbstractContextManager[None]:
        if self.devices is None or self.replica_devices is None:
            return contextlib.nullcontext()
        return device_copies(self.stages, self.devices, self.replica_devices, self._bound)

    def _get(self, values: Mapping[str, Any], name: str, k: int, grad: bool,
             events: Mapping[int, Any]) -> Any:
        """The value ``name`` as stage k receives it."""
        if name not in values:
            raise KeyError(
                f"stage {k} reads {name!r}, which no earlier stage produced and "
                f"flatten_inputs did not return (it has {sorted(values)})")
        p = self.wiring.producer_of(name)
        if p == k:
            return values[name]  # the last stage's own outputs, read by the loss
        with timed(self._recorder, k, "comm"):
            return receive(self.streams, values[name], p, k, events.get(p), grad)

    def _lazy(self, values: Mapping[str, Any], k: int, grad: bool,
              events: Mapping[int, Any]) -> OnDemand:
        """A dict for ``build_output`` that receives a value on stage k's device
        only when it is read (so unread activations never move)."""
        return OnDemand(values, lambda name: self._get(values, name, k, grad, events))

    def _run_stage(self, k: int, inputs: dict[str, Any], batch: int | None,
                   stash: Stash | None) -> tuple[Any, ...]:
        """Stage k on one micro-batch of ``batch`` samples: whole, or split along
        dim 0 among its replicas and concatenated back (see replicas.py)."""
        r = self.replicas[k]
        # one autocast region per stage and micro-batch, the first run and a recompute alike
        with autocast(self.precision, self.streams.device(k)):
            if r == 1:
                return self._run_replica(k, 0, inputs, stash)
            assert batch is not None and batch >= r, (k, batch, r)  # checked by batch_sizes
            written, whole = self.wiring.written & set(inputs), self.wiring.unbatched[k]
            chunks = own_copies(split_replicas(inputs, batch, r,
                                               whole={*self.shared_inputs, *whole}), written)
            outputs = [self._run_replica(k, i, chunk, stash) for i, chunk in enumerate(chunks)]
            inputs.update(written_back(chunks, written, self.shared_inputs))  # for later readers
            kept = [i for i, name in enumerate(self.wiring.outputs[k]) if name in whole]
            return tuple(merge_replicas(outputs, chunk_sizes(batch, r), whole=kept))

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
            inputs = to_device(inputs, dev)
            params = bound if stash is None else {
                **bound, **{name: t.to(dev) for name, t in stash.items()}
            }
        inputs = as_activations(self.precision, inputs, lambda name: self.wiring.received(k, name))

        def run(**given: Any) -> tuple[Any, ...]:
            return (stage(**given) if params is None
                    else torch.func.functional_call(stage, params, (), given))
        if (rule := self.selective[k]) is not None and torch.is_grad_enabled():
            outputs = remat.selective_run(run, inputs, rule, self.wiring.written,
                                          lambda: remat.buffers_restored(stage, k, self._bound))
        else:
            outputs = run(**inputs)
        self.wiring.check_outputs(k, outputs)
        if bound is not None:
            outputs = to_device(outputs, self.streams.device(k))
        return outputs

    def _forward(self, k: int, values: dict[str, Any], grad: bool, events: dict[int, Any],
                 batch: int | None, stash: Stash | None = None, *, copy: bool = False,
                 ) -> tuple[dict[str, Any], Any]:
        """Stage k's forward on one micro-batch's ``values``; records its event. ``copy``:
        return copies, taken first, of graph inputs a stage writes in place (to recompute)."""
        with self.streams.on(k):
            inputs = {name: self._get(values, name, k, grad, events)
                      for name in self.wiring.inputs[k]}
            before = {n: inputs[n].clone() for n in inputs if copy and n in self.wiring.written}
            outputs = self._run_stage(k, inputs, batch, stash)
            values.update({n: inputs[n] for n in self.wiring.written & set(inputs)})
            values.update(zip(self.wiring.outputs[k], outputs, strict=True))
        events[k] = self.streams.record(k)
        return {**inputs, **before}, outputs

    def _train_forward(self, k: int, m: int, state: StepState) -> None:
        values = state.values[m]
        events = state.fwd_events[m]
        stash = None
        if state.stashes is not None:
            with self.streams.on(k):
                stash = state.stashes.stash(k, self.streams.device(k))
        if self.recompute[k]:
            rng = remat.rng_state(self.streams.device(k))
            with torch.enable_grad(), remat.nothing_saved():  # as it runs again (recompute.py)
                inputs, outputs = self._forward(k, values, True, events, state.batch[m], stash,
                                                copy=True)
            values.update(zip(self.wiring.outputs[k], remat.passed_on(outputs), strict=True))
            state.saved[(k, m)] = (inputs, None, rng, stash)
        else:
            inputs, outputs = self._forward(k, values, True, events, state.batch[m], stash)
            state.saved[(k, m)] = (inputs, outputs, None, stash)
        if k == len(self.stages) - 1 and not self.recompute[k]:
            state.losses[m] = self._loss(k, m, state)

    def _loss(self, k: int, m: int, state: StepState) -> tuple[torch.Tensor, dict[str, Any]]:
        """loss_fn(build_output(values of m), target of m) on the last stage, weighted by
        micro-batch m's share of the samples (1/M for equal micro-batches; not weighted
        with weight stashing, where every micro-batch is its own update); returns it with
        the values build_output read (leaves for earlier stages')."""
        values = state.values[m]
        with self.streams.on(k), autocast(self.precision, self.streams.device(k)):
            out_in = self._lazy(values, k, True, state.fwd_events[m])
            target = to_device(state.targets[m], self.streams.device(k))
            loss = state.loss_fn(self.build_output(out_in), target)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(f"loss_fn must return a scalar tensor, got {loss!r}")
            weighted = loss * sample_share(state.batch, m)
            if not self.weight_stashing:  # with it every micro-batch is its own update
                loss = weighted
            total = weighted.detach()  # the mini-batch's mean loss, summed over m
            state.total_loss = total if state.total_loss is None else state.total_loss + total
        return loss, out_in

    def _backward(self, k: int, m: int, state: StepState, inputs_only: bool = False) -> None:
        inputs, outputs, rng, stash = state.saved.pop((k, m))
        values = state.values[m]
        with self.streams.on(k), received_grads(self.wiring, k, inputs) as grad_of:
            with (remat.buffers_restored(self.stages[k], k, self._bound) if self.recompute[k]
                  else contextlib.nullcontext()):
                if self.recompute[k]:
                    with torch.enable_grad(), remat.rng_restored(self.streams.device(k), rng):
                        outputs = self._run_stage(k, inputs, state.batch[m], stash)
                    values.update(zip(self.wiring.outputs[k], outputs, strict=True))
                tensors, grads, loss_inputs = self._output_grads(k, m, outputs, state)
                if inputs_only:
                    named = [*inputs.items(), *dict.items(loss_inputs)]
                    state.deferred[(k, m)] = input_backward(self.wiring, k, named, tensors, grads)
                elif tensors:
                    torch.autograd.backward(tensors, grads)
            done = self.streams.record(k)
            for name, leaf_value in [*inputs.items(), *dict.items(loss_inputs)]:
                p = self.wiring.producer_of(name)
                if p in (GRAPH_INPUT, k):
                    continue
                leaf_grads = [grad_of(x) for x in pytree.tree_leaves(leaf_value)]
                if all(g is None for g in leaf_grads):
                    continue
                with timed(self._recorder, k, "comm"):
                    sent = self.streams.send_grads(leaf_grads, p, done)
                state.grads[m].setdefault(name, []).append(sent)
            if stash is not None:
                assert state.stashes is not None
                state.stashes.update(k, stash)
        for name in self.wiring.outputs[k]:  # no later stage reads them any more
            values.pop(name, None)
        state.fwd_events[m].pop(k, None)

    def _output_grads(self, k: int, m: int, outputs: Any, state: StepState
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], dict[str, Any]]:
        """What B(k, m) differentiates: (tensors, their gradients, the values the loss
        read): the loss on the last stage, and each output with the gradients its
        consumers sent, summed."""
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        loss_inputs: dict[str, Any] = {}
        if k == len(self.stages) - 1:
            if self.recompute[k]:
                with torch.enable_grad():
                    state.losses[m] = self._loss(k, m, state)
            loss, loss_inputs = state.losses.pop(m)
            tensors.append(loss if self.scaler is None else self.scaler.scale(loss))
            grads.append(None)
        for name, out in zip(self.wiring.outputs[k], outputs, strict=True):
            contributions = state.grads[m].pop(name, [])
            for _g, event in contributions:
                self.streams.wait(k, event)
            summed = sum_grads([g for g, _e in contributions])
            if summed is None:
                continue
            for t, g in zip(pytree.tree_leaves(out), summed, strict=True):
                if isinstance(t, torch.Tensor) and t.requires_grad and g is not None:
                    tensors.append(t)
                    grads.append(g)
        return tensors, grads, loss_inputs
