"""Running a graph on the ``meta`` device: shapes, FLOPs and autograd without storage.

Analyses swap every parameter and buffer of the module for a meta tensor of the
same shape, dtype and ``requires_grad`` for the duration of a run, so a 70B
model is analysed on a laptop and a real model is never touched.

The run follows the target (``fxpipe.kernels.Execution``): fused attention as its device
runs it (inside a module the trace kept whole too: ``torch.nn.MultiheadAttention``), and
its precision. ``*-true`` casts floating state and inputs to that dtype.
``*-mixed`` runs under ``torch.autocast``, which has no meta dispatch key: those runs use
fake CPU tensors (``FakeTensorMode``, storage-less like meta ones) under CPU autocast, so
autograd saves what autocast really makes, the weight copies included. So does a graph
with an autocast region of its own (export's ``wrap_with_autocast``), whose body must
run in the dtype autocast picks. A graph traced for the GPU may call what the CPU does
not take (``histc`` of integers, transformers' expert counts): such a call runs as its
result would be on the GPU (``_ON_FAKE_CPU``).

A run given ``copies`` (``copied_from``: the nodes of layers tracing found repeated) runs
each repeated layer once: a node whose inputs are like those of the node it copies takes
a fresh value like that node's, so a run of 1,663 alike layers costs about one layer's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.nn.utils._named_member_accessor import swap_tensor
from torch.utils import _pytree as pytree

from fxpipe import kernels, meta
from fxpipe.kernels import Execution

__all__ = [
    "OP_NODES", "MetaRunner", "copied_from", "fresh_like", "inputs_to_meta", "named_state",
    "on_meta", "to_meta",
]

OP_NODES = frozenset({"call_function", "call_method", "call_module"})


def to_meta(
    tensor: torch.Tensor, *, dtype: torch.dtype | None = None, device: str = "meta"
) -> torch.Tensor:
    """A storage-less copy of ``tensor`` (``requires_grad`` kept): on the meta device, or
    a fake ``device`` tensor inside a ``FakeTensorMode``; floating ones cast to ``dtype``.

    A 0-dim integer tensor (a counter such as BatchNorm's ``num_batches_tracked``, which
    ``momentum=None`` turns into a Python float) is copied with its value on the meta
    device: it costs nothing, and mixes with meta tensors as a CPU scalar does."""
    floating = tensor.is_floating_point()
    cast = dtype if dtype is not None and floating else tensor.dtype
    if device == "meta" and tensor.dim() == 0 and not floating and not tensor.is_complex() and (
            not _storageless(tensor)):
        return tensor.detach().clone()
    if device == "meta" and _row_major(tensor):
        # what empty_like makes of it, without empty_like's Python decomposition on meta
        # (50 us against 2 an op: every parameter in every run, 20,000 at 1,663 layers)
        copy = torch.empty(tensor.shape, dtype=cast, device="meta")
    elif device == "meta":
        copy = torch.empty_like(tensor, dtype=cast, device="meta")
    else:
        copy = torch.empty(tensor.shape, dtype=cast, device=device)
    return copy.requires_grad_(tensor.requires_grad) if floating else copy


def _row_major(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain dense tensor (no subclass: a fake tensor, say) with
    the strides ``torch.empty`` gives its shape. Where a size-1 dimension lets several
    stride conventions hold (a channels-last (n, c, 1, 1), a (1, k) of stride (100, 1)),
    empty_like picks one by its own rules: such tensors are left to it."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return False
    expected = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride()), strict=True):
        if stride != expected:
            return False
        expected *= max(size, 1)
    return True


def named_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (tied ones repeated)."""
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    named += module.named_buffers(remove_duplicate=False)
    return named


@contextmanager
def on_meta(
    module: torch.nn.Module, *, dtype: torch.dtype | None = None, device: str = "meta"
) -> Iterator[dict[str, torch.Tensor]]:
    """Swap the module's state for storage-less copies (``to_meta``); yields name -> copy.

    Tied parameters stay tied: one copy serves every name of one original. Each slot (a
    submodule's attribute) is swapped once and put back after, also where one submodule
    has several names (transformers 4.x registers T5's shared embedding as ``shared``,
    ``encoder.embed_tokens`` and ``decoder.embed_tokens``): torch's
    ``_reparametrize_module`` swaps such a slot once per name and so put a copy back.
    """
    by_identity: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    slots: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.Tensor]] = {}
    for name, tensor in named_state(module):
        if id(tensor) not in by_identity:
            by_identity[id(tensor)] = to_meta(tensor, dtype=dtype, device=device)
        state[name] = by_identity[id(tensor)]
        path, _, attribute = name.rpartition(".")
        owner = module.get_submodule(path)
        slots.setdefault((id(owner), attribute), (owner, attribute, state[name]))
    originals = [(owner, attribute, swap_tensor(owner, attribute, copy))
                 for owner, attribute, copy in slots.values()]
    try:
        yield state
    finally:
        for owner, attribute, original in originals:
            swap_tensor(owner, attribute, original)


def inputs_to_meta(
    values: Any, *, dtype: torch.dtype | None = None, device: str = "meta"
) -> Any:
    """Every tensor leaf of ``values`` made storage-less (``to_meta``)."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: to_meta(t, dtype=dtype, device=device), values
    )


def _storageless(value: torch.Tensor) -> bool:
    return value.is_meta or is_fake(value)


def _device_to(value: Any, device: str) -> Any:
    if isinstance(value, torch.device):
        return torch.device(device)
    if isinstance(value, torch.Tensor) and not _storageless(value):
        return to_meta(value, device=device)  # a constant the graph holds (a mask, a table)
    return value


def _is_device_name(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return False
    return True


def _autocast_region(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` or a body of its higher-order ops enters an autocast region."""
    return any(node.op == "call_function"
               and node.target is torch.ops.higher_order.wrap_with_autocast
               for node in gm.graph.nodes) or any(
        isinstance(child, torch.fx.GraphModule) and _autocast_region(child)
        for child in gm.children())


@contextmanager
def _fused_attention(execution: Execution) -> Iterator[None]:
    """While open, ``torch.nn.functional.scaled_dot_product_attention`` called inside a
    node (by a module the trace kept whole, as ``F.multi_head_attention_forward`` does,
    or by a function it calls) runs as the target's kernel does, as a node of its own
    does (``kernels.scaled_dot_product_attention``). A node of its own is matched by its
    target, torch's function, which the graph holds whatever this rebinds."""
    fused = F.scaled_dot_product_attention

    def as_the_target_runs(*args: Any, **kwargs: Any) -> Any:
        return kernels.scaled_dot_product_attention(execution, *args, **kwargs)

    F.scaled_dot_product_attention = as_the_target_runs
    try:
        yield
    finally:
        F.scaled_dot_product_attention = fused


def _histc(values: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``histc`` of integers, which the GPU counts and the CPU refuses: counted in float,
    returned in the input's dtype (a GPU's result)."""
    if values.is_floating_point():
        return torch.histc(values, *args, **kwargs)
    return torch.histc(values.float(), *args, **kwargs).to(values.dtype)


# Calls a graph traced on the meta device (where transformers takes its GPU paths) makes
# that the fake CPU tensors of a *-mixed run would refuse, and what runs in their place.
_ON_FAKE_CPU: dict[Any, Any] = {torch.ops.aten.histc.default: _histc, torch.histc: _histc}


def copied_from(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each op node of a layer tracing copied (``meta.COPY_OF``) -> the node it copies, an
    earlier node of the same op, target (or a module alike: ``_alike``) and number of
    inputs: given inputs like that node's, the copy runs as it does. A node whose record
    no longer names such a node (the graph changed since) is left out, to be run."""
    by_name: dict[str, torch.fx.Node] = {}
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op in OP_NODES and meta.COPY_OF.has(node):
            template = by_name.get(meta.COPY_OF.get(node))
            if template is not None and _runs_alike(gm, template, node):
                copies[node] = template
        by_name[node.name] = node
    return copies


def _runs_alike(gm: torch.fx.GraphModule, a: torch.fx.Node, b: torch.fx.Node) -> bool:
    if a.op != b.op or len(a.all_input_nodes) != len(b.all_input_nodes):
        return False
    if a.target == b.target:
        return True
    return a.op == "call_module" and _alike(gm.get_submodule(str(a.target)),
                                            gm.get_submodule(str(b.target)))


def _alike(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Two of torch's own modules that compute alike: one class, mode and configuration,
    parameters and buffers of the same names, shapes, dtypes and ``requires_grad``."""

    def state(m: torch.nn.Module) -> list[tuple[Any, ...]]:
        return [(name, t.shape, t.dtype, t.requires_grad)
                for name, t in [*m.named_parameters(), *m.named_buffers()]]

    return (type(a) is type(b) and type(a).__module__.startswith("torch.nn.")
            and a.training == b.training and a.extra_repr() == b.extra_repr()
            and state(a) == state(b))


def fresh_like(value: Any, *, exact: bool = False) -> Any:
    """``value`` with every tensor leaf replaced by a new storage-less one of the same
    shape, strides, dtype, device and ``requires_grad`` (not a leaf, so in-place ops on it
    stay legal). One that requires grad and has gaps between its elements (a slice,
    ``split``'s parts) comes back dense, unless ``exact``: then it is a view with its
    strides, as a copied layer's values must be for the nodes after them to see the
    inputs the copied layer's did (``MetaRunner``)."""

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if exact and t.requires_grad and not t.is_contiguous() and t.numel() > 0:
            span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(),
                                                                      strict=True))
            base = torch.empty(span, dtype=t.dtype, device=t.device).requires_grad_().clone()
            return base.as_strided(t.shape, t.stride())
        made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return made.requires_grad_().clone() if t.requires_grad else made

    if isinstance(value, torch.Tensor):  # the common case, without pytree's walk
        return fresh(value)
    return pytree.tree_map_only(torch.Tensor, fresh, value)


class MetaRunner(torch.fx.Interpreter):
    """Runs a graph on the meta device, whatever device the trace recorded.

    torch.export writes the tracing device into the graph (``aten.to(x, device=cpu)``,
    ``arange(..., device=cpu)``) and may hold constant tensors; both are mapped to
    meta, and ``.cpu()`` / ``.cuda()`` / ``.to("cpu")`` stay on meta.
    """

    def __init__(self, gm: torch.fx.GraphModule, execution: Execution | None = None, *,
                 device: str | None = None,
                 copies: dict[torch.fx.Node, torch.fx.Node] | None = None) -> None:
        super().__init__(gm, garbage_collect_values=True)
        # A node of a copied layer -> the node it copies (``copied_from``): given inputs
        # like that node's, it is not run and its value is a fresh one like that node's.
        self.copies = copies or {}
        self.copied = frozenset(self.copies.values())
        self.copy_runs: dict[torch.fx.Node, tuple[list[Any], Any]] = {}  # inputs, result
        self.meta_state: dict[str, torch.Tensor] = {}
        self.state_ids: frozenset[int] = frozenset()  # ids of meta_state's tensors
        self.execution = execution if execution is not None else Execution()
        precision = self.execution.precision
        self.autocast = precision.dtype if precision is not None and precision.mixed else None
        self.cast = precision.dtype if precision is not None and not precision.mixed else None
        if device is None:  # fake CPU where autocast runs, see above
            device = "cpu" if self.autocast is not None or _autocast_region(gm) else "meta"
        self.device = device

    def run_on_meta(self, *flat_inputs: Any) -> Any:
        """Run once; grad mode is on inside and restored after, even on failure."""
        with ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            if self.device == "cpu":
                stack.enter_context(FakeTensorMode())
            if self.autocast is not None:
                stack.enter_context(torch.autocast("cpu", dtype=self.autocast))
            # attention a node calls inside (a module the trace kept whole,
            # torch.nn.MultiheadAttention; a function) runs as a node of its own does
            stack.enter_context(_fused_attention(self.execution))
            state = stack.enter_context(on_meta(self.module, dtype=self.cast, device=self.device))
            self.meta_state = state  # qualified name -> the tensor standing in for it
            self.state_ids = frozenset(id(t) for t in state.values())
            inputs = inputs_to_meta(flat_inputs, dtype=self.cast, device=self.device)
            return self.run(*inputs)

    def run_node(self, n: torch.fx.Node) -> Any:
        """Run ``n``, or take the run of the node it copies (``copies``) where ``n``'s
        inputs are like that node's were: shapes, strides, dtypes, grad, parameter or not,
        and equal values that are no tensors. A node that changed its inputs in place when
        it ran is run in every copy."""
        template = self.copies.get(n)
        if template is None and n not in self.copied:
            return super().run_node(n)
        given = self._input_specs(n)
        ran = self.copy_runs.get(template) if template is not None else None
        if ran is not None and _equal(ran[0], given):
            return fresh_like(ran[1], exact=True)
        result = super().run_node(n)
        # a result fresh_like cannot remake (a sparse tensor) leaves the copies to run
        if n in self.copied and _equal(given, self._input_specs(n)) and all(
                t.layout == torch.strided for t in pytree.tree_leaves(result)
                if isinstance(t, torch.Tensor)):
            self.copy_runs[n] = (given, fresh_like(result, exact=True))
        return result

    def _input_specs(self, n: torch.fx.Node) -> list[Any]:
        def spec(t: torch.Tensor) -> tuple[Any, ...]:
            return (t.shape, t.stride(), t.dtype, t.device.type, t.requires_grad,
                    id(t) in self.state_ids)

        return [spec(value) if isinstance(value, torch.Tensor)  # without pytree's walk
                else pytree.tree_map_only(torch.Tensor, spec, value)
                for value in (self.env[node] for node in n.all_input_nodes)]

    def fetch_args_kwargs_from_env(self, n: torch.fx.Node) -> tuple[Any, dict[str, Any]]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        args, kwargs = pytree.tree_map(
            lambda v: _device_to(v, self.device), (tuple(args), dict(kwargs))
        )
        if n.op == "call_method" and n.target == "to":
            args = tuple(self.device if _is_device_name(a) else a for a in args)
        if isinstance(kwargs.get("device"), str):
            kwargs["device"] = self.device
        return args, kwargs

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return _device_to(super().get_attr(target, args, kwargs), self.device)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.higher_order.wrap_with_set_grad_enabled:
            # export's region under set_grad_enabled: its body is a graph of its own,
            # interpreted here so its device literals map to meta too.
            enabled, body, *inputs = args
            with torch.set_grad_enabled(enabled):
                return MetaRunner(body, self.execution, device=self.device).run(*inputs)
        if target in kernels.SDPA_TARGETS:
            return kernels.scaled_dot_product_attention(self.execution, *args, **kwargs)
        stand_in = _ON_FAKE_CPU.get(target) if self.device == "cpu" else None
        if stand_in is not None:
            return stand_in(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in ("cpu", "cuda") and isinstance(args[0], torch.Tensor):
            return args[0]
        return super().call_method(target, args, kwargs)


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for specs, False where a value's ``==`` gives no plain bool."""
    try:
        return bool(a == b)
    except Exception:
        return False
