"""Tracing with ``torch.fx.symbolic_trace``, the first choice: it keeps ``call_module``
nodes, which read best in generated code.

``symbolic_trace`` keeps sizes symbolic by itself, and here a call of the model's own
``torch.autograd.Function`` as one node (``functions.py``), and a module with backward
hooks as one call (``hooks.py``). It keeps every other torch.nn module as one call too,
but for torch.nn's stacks of layers (``_STACKS``): a stack of 48 layers as one node
could not be cut between its layers. It also runs through Python that it cannot
record: a grad-mode or autocast region, a tensor computed in forward from no traced
value (refused here, so the caller falls back to ``torch.export``, which records them),
a graph that traces and then fails to run (run once on meta tensors to find out). Which
input dimensions may vary is learnt by running the graph on meta tensors with each
dimension resized.

A model whose layers repeat is traced one layer of a kind at a time: each later layer of
a list whose class, attributes and call match one already traced replays that one's
nodes (``replay.py``), checked against a second layer traced and the list's last. This is
not ``torch.export``'s shortcut (``repeats.py``: export two layers, copy the second),
which needs the recorded run of the whole model (``layer_runs.record``) to know the
copies right: under ``symbolic_trace`` a layer sees proxies, not values, so what it
records follows from what the key compares, and the record would cost four times the
trace it spares (GPipe's 1,663-layer Transformer-L: 18.6 s of CPU against 4.8 s).
``mark_copies`` then reads the repeated layers off the graph, node for node, and the
runs below and the passes run each such layer once.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx

from fxpipe.forked import FORK_MIN_NODES, Forked
from fxpipe.metadevice import MetaRunner, copied_from
from fxpipe.tracing.functions import kept_functions
from fxpipe.tracing.hooks import HookedLeaves, backward_hooked
from fxpipe.tracing.records import InputShape
from fxpipe.tracing.repeats import mark_copies
from fxpipe.tracing.replay import LayerReplay, ReplayMismatch

__all__ = ["BufferUpdateError", "ConstantError", "GradRegionError", "symbolic_graph"]

# Traced through, not kept as one call: each of their layers is one. (Their forward
# branches on its inputs, so a model holding one is exported instead.)
_STACKS = (torch.nn.TransformerEncoder, torch.nn.TransformerDecoder, torch.nn.Transformer)


class _Tracer(HookedLeaves):
    """``HookedLeaves``, tracing through torch.nn's stacks of layers (``_STACKS``) and
    replaying a recorded layer for each later one alike (``replay.py``)."""

    def __init__(self, replay: LayerReplay) -> None:
        super().__init__()
        self._replay = replay

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, _STACKS) and not backward_hooked(m):
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._replay.call(self, m, self.path_of_module(m), args, kwargs,
                                 lambda: super(_Tracer, self).call_module(m, forward, args, kwargs))

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        self._replay.cache = parameter_proxy_cache
        return super().getattr(attr, attr_val, parameter_proxy_cache)


def symbolic_graph(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], replay: bool = True
) -> tuple[torch.fx.GraphModule, tuple[Any, ...], tuple[InputShape, ...]]:
    """``model`` traced by ``symbolic_trace``, the example inputs in placeholder order and
    the shape of each tensor input; raises whatever stops it. ``replay``: alike layers
    are traced once and replayed (``replay.py``); a model whose last layer then traces
    otherwise is traced again without."""
    try:
        gm = _traced(model, LayerReplay(model, enabled=replay))
    except ReplayMismatch:
        gm = _traced(model, LayerReplay(model, enabled=False))
    flat = _symbolic_inputs(model, gm, args, kwargs)
    copies = _copies(gm, model)
    # The graph run resized (a run per size) in a forked child while it is checked here
    big = len(gm.graph.nodes) >= FORK_MIN_NODES
    with Forked(lambda: _probe_dynamic(gm, flat, copies), in_child=big) as probed:
        _check_runs(gm, flat, copies)
        return gm, flat, probed.result()


def _traced(model: torch.nn.Module, replay: LayerReplay) -> torch.fx.GraphModule:
    """``model``'s graph, where symbolic_trace records it rightly; raises where not."""
    # the grad-mode patches come off first: putting buffers back enters no_grad
    with _buffer_updates(model) as updated, _grad_regions() as entered, kept_functions(), \
            _constants(model) as constants:
        tracer = _Tracer(replay)
        graph = tracer.trace(model)
        gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    if constants:
        value = getattr(gm, constants[0], None)
        shape = f", of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
        raise ConstantError(
            f"forward computes a value from no traced one ({constants[0]}{shape}: a buffer "
            "cloned, a tensor made from Python values), which symbolic_trace keeps as "
            "the value it had while tracing instead of recording how forward computes it"
        )
    if entered:
        raise GradRegionError(
            f"forward enters {entered[0]}, which symbolic_trace does not record"
        )
    if updated:
        raise BufferUpdateError(
            f"forward updates the buffer {updated[0]} in place in Python code, which "
            "symbolic_trace runs once while tracing instead of recording it"
        )
    return gm


class GradRegionError(RuntimeError):
    """symbolic_trace ran through a grad-mode or autocast region it cannot record."""


_REGIONS = (
    (torch.autograd.grad_mode.no_grad, "__enter__", "torch.no_grad()"),
    (torch.autograd.grad_mode.enable_grad, "__enter__", "torch.enable_grad()"),
    (torch.autograd.grad_mode.set_grad_enabled, "__init__", "torch.set_grad_enabled()"),
    (torch.autograd.grad_mode.inference_mode, "__enter__", "torch.inference_mode()"),
    (torch.amp.autocast_mode.autocast, "__enter__", "torch.autocast()"),
)


@contextmanager
def _grad_regions() -> Iterator[list[str]]:
    """Note every grad-mode or autocast region entered (the stage would run it with
    autograd on, in full precision: torch.export records these regions, so the caller
    falls back to it)."""
    entered: list[str] = []
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in _REGIONS]

    def noting(original: Callable[..., Any], what: str) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            entered.append(what)
            return original(*args, **kwargs)
        return method

    for (cls, name, original), (_, _, what) in zip(saved, _REGIONS, strict=True):
        setattr(cls, name, noting(original, what))
    try:
        yield entered
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


class ConstantError(RuntimeError):
    """symbolic_trace kept a tensor forward computes as a constant of the graph."""


@contextmanager
def _constants(model: torch.nn.Module) -> Iterator[list[str]]:
    """The names of the constants the tracer makes of tensors forward computes from no
    traced value (``self.buf.clone()``, ``torch.arange(8)``): it stores each on the
    model itself as ``_tensor_constant0``..., where the stages would bind it from the
    model, which has no such attribute once built again, and would read the value it had
    while tracing, not the buffer's value now or a fresh draw of ``torch.randn``. They
    are taken off the model again; torch.export records how forward computes them."""
    before = set(vars(model))
    made: list[str] = []
    try:
        yield made
    finally:
        for name in sorted(set(vars(model)) - before, key=_natural):
            if _MADE.fullmatch(name):
                made.append(name)
                delattr(model, name)


# the names the tracer gives what it stores on the model (``Tracer.create_arg``)
_MADE = re.compile(r"_(tensor_constant|torchbind_obj|tree_spec_constant|opaque_obj)\d+")


def _natural(name: str) -> tuple[str, int]:
    """``_tensor_constant2`` before ``_tensor_constant10``."""
    stem = name.rstrip("0123456789")
    return stem, int(name[len(stem):] or 0)


class BufferUpdateError(RuntimeError):
    """symbolic_trace ran an in-place update of a buffer instead of recording it."""


@contextmanager
def _buffer_updates(model: torch.nn.Module) -> Iterator[list[str]]:
    """Note every buffer that an in-place op changes while symbolic_trace runs forward,
    and put its value back. The tracer records ops on the traced input; an op on a real
    tensor of the model (timm's ``self.num_batches_tracked.add_(1)``, copied from
    BatchNorm's forward) runs once, now, and the stages would never run it. torch.export
    records such updates, so the caller falls back to it."""
    saved = [(name, b, b._version, b.detach().clone())
             for name, b in model.named_buffers(remove_duplicate=True)]
    updated: list[str] = []
    try:
        yield updated
    finally:
        with torch.no_grad():
            for name, buffer, version, value in saved:
                if buffer._version != version:
                    updated.append(name)
                    buffer.copy_(value)


def _symbolic_inputs(
    model: torch.nn.Module, gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """The example inputs in the order of the traced graph's placeholders."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    flat = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = str(node.target)
        if name.startswith("*"):
            raise TypeError(f"forward takes {name}, which symbolic_trace cannot bind")
        flat.append(bound.arguments[name])
    return tuple(flat)


def _copies(gm: torch.fx.GraphModule, model: torch.nn.Module
            ) -> dict[torch.fx.Node, torch.fx.Node]:
    """The nodes of repeated layers and those they copy (``mark_copies``), for the runs
    below to run each layer like an earlier one once; the caller keeps the names. Where
    naming them fails, nothing is named and the runs run every node: the caller names
    them again outside its fallback to torch.export, so such a fault surfaces as
    fxpipe's own and is not taken for a tracing failure."""
    try:
        mark_copies(gm, model)
    except Exception:
        return {}
    return copied_from(gm)


def _check_runs(gm: torch.fx.GraphModule, flat: tuple[Any, ...],
                copies: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """Run the graph once on meta tensors: symbolic_trace can succeed on a graph that fails.
    A copied layer whose inputs are like those of the layer it copies runs as that one did
    (``MetaRunner``'s ``copies``)."""
    MetaRunner(gm, copies=copies).run_on_meta(*flat)


def _probe_dynamic(gm: torch.fx.GraphModule, flat: tuple[Any, ...],
                   copies: dict[torch.fx.Node, torch.fx.Node]) -> tuple[InputShape, ...]:
    """Which input dimensions a symbolic_trace graph lets vary, learnt by running it on meta
    tensors with each dimension doubled (every input that has that size at that index
    together, so inputs that must agree, like ids and their mask, still do)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [(i, x) for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    # (dim index, size) -> the range assumed: unbounded where twice the size runs, up to
    # the traced size where only half of it does (a model with a maximum length)
    free: dict[tuple[int, int], tuple[int, int | None]] = {}
    for key in sorted({(d, size) for _, x in tensors for d, size in enumerate(x.shape)}):
        d, size = key
        if _runs_resized(gm, flat, copies, tensors, d, size, 2 * size):
            free[key] = (1, None)
        elif size > 1 and _runs_resized(gm, flat, copies, tensors, d, size, size // 2):
            free[key] = (1, size)
    return tuple(
        InputShape(
            placeholders[i].name,
            tuple(x.shape),
            tuple(free.get((d, size)) for d, size in enumerate(x.shape)),
        )
        for i, x in tensors
    )


def _runs_resized(
    gm: torch.fx.GraphModule,
    flat: tuple[Any, ...],
    copies: dict[torch.fx.Node, torch.fx.Node],
    tensors: list[tuple[int, torch.Tensor]],
    dim: int,
    size: int,
    new_size: int,
) -> bool:
    probe = list(flat)
    for i, x in tensors:
        if x.dim() > dim and x.size(dim) == size:
            shape = list(x.shape)
            shape[dim] = new_size
            probe[i] = torch.empty(shape, dtype=x.dtype, device="meta")
    try:
        MetaRunner(gm, copies=copies).run_on_meta(*probe)
    except Exception:
        return False
    return True
