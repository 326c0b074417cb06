"""A generated stage as torch.distributed.pipelining wants it.

torch's ``PipelineStage`` passes a flat tuple of tensors from stage k to stage
k + 1 only. Each generated stage (inputs by name, a tuple of outputs) is
wrapped in a ``StageAdapter`` whose forward takes and returns flat tuples in
the order of the ``WIRES`` table: ``WIRES[k]`` names the values stage k
receives (``WIRES[0]``: the graph inputs any stage reads). A value that skips
stages (a U-Net skip, an attention mask) is in every wire between its producer
and its last reader, so the stages in between pass it along::

    stage 0 ──(x1, x2)──► stage 1 ──(x1, y)──► stage 2      x1: made by 0, read by 2

The last stage returns the model's output (``build_output``) for ``loss_fn``;
torch's schedules take only tensors from a stage, so an output with structure (a
Hugging Face model's dict) leaves the stage as its tensor leaves and ``loss_fn``
gets it rebuilt.
A tensor travels as contiguous memory. One the model keeps in another order (a
transposed result, or an elementwise op's result on one) travels in its own memory order
(``memory_order``: permuted so that it is contiguous, no copy) and is permuted back on
arrival: the next stage gets the strides the model had, which a ``view`` of it needs.
Values that are not tensors (``x.size(1)``, a float keyword argument) cannot
travel; they are read from the example micro-batch and baked into the
adapters as constants (micro-batch shapes are fixed by the static metadata
anyway), and ``train_step`` checks that a baked graph input keeps its value.

A stage the plan recomputes keeps only what it receives per micro-batch (and, recomputed
selectively, the outputs of its matmuls and attention): its forward runs under
``torch.utils.checkpoint`` (non-reentrant), which runs it again in the backward with the
random state of the first run (the same dropout masks); what the
run again writes into buffers is undone (recompute.py), and graph inputs the stage
writes in place are written in copies, so both runs start from the same values. Under
a zero-bubble schedule torch runs the backward in two passes (input, then weight
gradients), and checkpoint runs the forward again in each: one forward more than the
plan counts and the single-process runner runs.
"""

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from .microbatch import torch_chunk_spec
from .mixed_precision import as_activations, autocast, example_device
from .recompute import (
    EachTime,
    buffers_restored,
    keep_rule,
    modes,
    selective_contexts,
)

__all__ = [
    "StageAdapter",
    "check_constants",
    "example_values",
    "is_constant",
    "on_model_output",
    "split_wire",
    "torch_schedule_kwargs",
    "wire_example",
]


class StageAdapter(nn.Module):
    """A generated stage as torch's pipelining wants it: a flat tuple of tensors
    in (``receives``), a flat tuple out (``sends``), or the model's output at the
    last stage. ``constants`` are the non-tensor values baked in."""

    def __init__(
        self,
        stage: nn.Module,
        receives: Sequence[str],
        sends: Sequence[str] | None,
        constants: Mapping[str, Any],
        build_output: Callable[[dict[str, Any]], Any],
        *,
        precision: str = "32-true",
        device: torch.device | None = None,
        recompute: str | bool = "none",
    ) -> None:
        super().__init__()
        self.stage = stage
        # how the plan recomputes this stage (recompute.MODES): "full" runs its forward again
        # in the backward, "selective" all of it but the matmuls and attention
        (self.recompute,) = modes([recompute], 1)
        # the plan's precision: the stage's forward runs under its autocast on ``device``
        self.precision = precision
        self.device = device
        self.receives = tuple(receives)
        self.sends = None if sends is None else tuple(sends)
        self.constants = dict(constants)
        self.build_output = build_output
        self.tied: list[tuple[Any, nn.Parameter]] = []  # (process group, this rank's copy)
        self.replica_group: Any = None  # the ranks running this stage (replicated stages)
        self.microbatches = 1  # per step, set by build_schedule
        # torch runs the backward as I and W (zero-bubble schedules): send fresh copies, which
        # torch detaches in place, and contiguous input gradients (torch_zero_bubble.py)
        self.split_backward = False
        # torch_zero_bubble.py: called once, with the first micro-batch's received tensors and
        # outputs, to look at the stage's autograd graph
        self.check_graph: Callable[[tuple[torch.Tensor, ...], Any], None] | None = None
        # the shape of each received tensor in the example micro-batch it was built with:
        # torch's PipelineStage sends and receives at these shapes (see check_feed)
        self.input_shapes: tuple[tuple[int, ...], ...] = ()
        # per sent tensor: the dim order it travels in (memory_order); per received one:
        # the order that puts it back as the model had it; None where it travels as it is
        self.send_orders: tuple[tuple[int, ...] | None, ...] = ()
        self.restore_orders: tuple[tuple[int, ...] | None, ...] = ()
        # last stage with a structured output: its leaves (None where a tensor goes) and
        # structure; it returns only the tensors, ``rebuild_output`` puts them back
        self.output_leaves: list[Any] | None = None
        self.output_spec: Any = None

    def forward(self, *flat: torch.Tensor) -> Any:
        if self.split_backward:
            _contiguous_grads(flat)
        if self.recompute != "none" and torch.is_grad_enabled():
            outputs = checkpoint(self._run, *flat, use_reentrant=False,
                                 context_fn=self._recompute_contexts)
        else:
            outputs = self._run(*flat)
        if self.check_graph is not None and torch.is_grad_enabled():
            check, self.check_graph = self.check_graph, None  # every micro-batch's is alike
            check(flat, outputs)
        return outputs

    def _recompute_contexts(self) -> tuple[Any, Any]:
        """(the first run's context, the run again's): each run again leaves buffers as
        the first run left them; a selective stage's keeps the matmuls' outputs."""
        def restored() -> contextlib.AbstractContextManager[None]:
            return buffers_restored(self.stage, 0, {})

        rule = keep_rule(self.recompute)
        if rule is not None:
            return selective_contexts(restored, rule)
        return contextlib.nullcontext(), EachTime(restored)

    def _run(self, *flat: torch.Tensor) -> Any:
        values: dict[str, Any] = dict(self.constants)
        orders = self.restore_orders or (None,) * len(flat)
        values.update((name, x if order is None else x.permute(order))
                      for name, x, order in zip(self.receives, flat, orders, strict=True))
        if self.recompute != "none":  # both runs start from the received values, not written ones
            for name in getattr(self.stage, "WRITES", ()):
                if isinstance(values.get(name), torch.Tensor):
                    values[name] = values[name].clone()
        names = cast(tuple[str, ...], self.stage.INPUTS)
        # every received tensor is a leaf torch's PipelineStage made (on the first stage
        # the micro-batch, which needs no gradient)
        inputs = as_activations(self.precision, {name: values[name] for name in names},
                                lambda _name: True)
        with autocast(self.precision, self.device):  # one region per stage and micro-batch
            outputs = self.stage(**inputs)
            values.update(zip(cast(tuple[str, ...], self.stage.OUTPUTS), outputs, strict=True))
            output = self.build_output(values) if self.sends is None else None
        if self.sends is None:
            if self.output_leaves is None:
                return output
            return tuple(x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor))
        # sends need contiguous memory: each in its memory order (a transposed view may be
        # one of the values)
        orders = self.send_orders or (None,) * len(self.sends)
        sent = [values[name] if order is None else values[name].permute(order)
                for name, order in zip(self.sends, orders, strict=True)]
        if self.split_backward:
            return tuple(x.clone(memory_format=torch.contiguous_format) for x in sent)
        return tuple(x.contiguous() for x in sent)

    def travel_in_memory_order(self, examples: Mapping[str, Any], *, first: bool,
                               device: torch.device) -> tuple[torch.Tensor, ...]:
        """Set the order each tensor travels in (``memory_order`` of its example; the
        first stage's come from the micro-batch as they are) and ``input_shapes``; return
        empty tensors as this stage receives them."""
        received = tuple(None if first else memory_order(examples[name])
                         for name in self.receives)
        self.restore_orders = tuple(None if order is None else _inverse(order)
                                    for order in received)
        self.send_orders = tuple(memory_order(examples[name]) for name in self.sends or ())
        inputs = tuple(wire_example(examples[name], order, device)
                       for name, order in zip(self.receives, received, strict=True))
        self.input_shapes = tuple(tuple(x.shape) for x in inputs)
        return inputs

    def flatten_output(self, example: Any) -> None:
        """From now on return the tensor leaves of an output that is more than a tensor
        or a tuple of tensors (``example``: one micro-batch's output)."""
        if isinstance(example, torch.Tensor) or (
                isinstance(example, tuple) and all(isinstance(x, torch.Tensor) for x in example)):
            return
        leaves, self.output_spec = pytree.tree_flatten(example)
        self.output_leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]

    def rebuild_output(self, tensors: Any) -> Any:
        """The model's output from what ``forward`` returned."""
        if self.output_leaves is None:
            return tensors
        given = iter(tensors if isinstance(tensors, tuple) else (tensors,))
        leaves = [next(given) if x is None else x for x in self.output_leaves]
        return pytree.tree_unflatten(leaves, self.output_spec)


def example_values(
    stage_classes: Sequence[Callable[[nn.Module], nn.Module]],
    flatten_inputs: Callable[..., dict[str, Any]],
    build_output: Callable[[dict[str, Any]], Any],
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    precision: str = "32-true",
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Every wire value of one micro-batch as a fake tensor (shape, dtype,
    requires_grad; nothing allocated), running all stages under FakeTensorMode, each
    under the plan's autocast as ``StageAdapter`` runs it (on fake tensors of
    ``device`` when mixed: see ``precision.example_device``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    stages = [cls(model) for cls in stage_classes]
    values: dict[str, Any] = {}
    where = example_device(precision, device)

    def fake(t: torch.Tensor) -> torch.Tensor:
        out = mode.from_tensor(t)
        return out if where.type == "cpu" else out.to(where)

    with mode, torch.enable_grad():
        given = pytree.tree_map_only(torch.Tensor, fake, (args, kwargs))
        values.update(flatten_inputs(*given[0], **given[1]))
        for stage in stages:
            state = _fake_state(stage, where)
            inputs = {name: values[name] for name in cast(tuple[str, ...], stage.INPUTS)}
            with autocast(precision, where):
                outputs = torch.func.functional_call(stage, state, (), inputs)
            values.update(zip(cast(tuple[str, ...], stage.OUTPUTS), outputs, strict=True))
        with autocast(precision, where):
            values["__output__"] = build_output(values)
    return values


def split_wire(wire: Sequence[str], k: int, examples: dict[str, Any]
               ) -> tuple[tuple[str, ...], dict[str, Any]]:
    """``wire`` (WIRES[k]) as (tensor names, baked constants)."""
    tensors: list[str] = []
    constants: dict[str, Any] = {}
    for name in wire:
        value = examples[name]
        if isinstance(value, torch.Tensor):
            tensors.append(name)
        elif is_constant(value):
            constants[name] = value
        else:
            raise ValueError(
                f"{name!r} reaches stage {k} from an earlier stage but is a "
                f"{type(value).__name__}, neither a tensor nor a constant: "
                "torch.distributed.pipelining passes only tensors between stages; "
                "cut the model where no such value crosses"
            )
    return tuple(tensors), constants


def on_model_output(stages: Sequence[Any], loss_fn: Callable[[Any, Any], torch.Tensor] | None
                    ) -> Callable[[Any, Any], torch.Tensor] | None:
    """``loss_fn`` for torch's schedules, which hand it the last stage's tensors: on the
    model's output rebuilt from them (``StageAdapter.rebuild_output``)."""
    last = next((cast(StageAdapter, s.submod) for s in stages if s.is_last), None)
    if loss_fn is None or last is None or last.output_leaves is None:
        return loss_fn
    return lambda output, target: loss_fn(last.rebuild_output(output), target)


def torch_schedule_kwargs(stages: Sequence[Any],
                          loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                          shared: Collection[str]) -> dict[str, Any]:
    """What torch's schedule classes take for a rank's ``stages`` besides M: the loss on
    the model's output (``on_model_output``), and ``args_chunk_spec``, the first stage's
    graph inputs cut into micro-batches as ``microbatch.split_inputs`` cuts them, the
    ``shared`` ones whole (None on a rank without the first stage: it is fed nothing)."""
    first = next((cast(StageAdapter, s.submod) for s in stages if s.is_first), None)
    spec = None if first is None else torch_chunk_spec(first.receives, first.input_shapes, shared)
    return {"loss_fn": on_model_output(stages, loss_fn), "args_chunk_spec": spec}


def check_constants(adapter: StageAdapter, values: Mapping[str, Any]) -> None:
    """A graph input baked into the stages must keep the value it was built with."""
    for name, baked in adapter.constants.items():
        if name in values and values[name] != baked:
            raise ValueError(
                f"graph input {name!r} is {values[name]!r} but the stages were built "
                f"with {baked!r} (non-tensor inputs are baked in at pipeline_stage)"
            )


def check_feed(names: Sequence[str], shapes: Sequence[tuple[int, ...]],
               feed: Sequence[torch.Tensor], microbatches: int,
               shared: Collection[str] = ()) -> None:
    """The graph inputs ``feed`` (``names``) must be ``microbatches`` micro-batches of the
    ``shapes`` the stages were built with (a ``shared`` input: that shape, whole in every
    one): torch's ``PipelineStage`` allocates its send and receive buffers at that shape,
    and sizes that cross stages as numbers are baked in with it, so another shape would
    fail inside torch or compute with the old size."""
    for name, x, shape in zip(names, feed, shapes, strict=True):
        whole = name in shared or not shape
        want = shape if whole else (microbatches * shape[0], *shape[1:])
        if tuple(x.shape) != want:
            built = (f"with it of shape {shape}, handed whole to every micro-batch" if whole
                     else f"for {microbatches} micro-batches of shape {shape}, {want} in all")
            raise ValueError(
                f"graph input {name!r} has shape {tuple(x.shape)}, but under torchrun the "
                f"stages were built {built}: torch.distributed.pipelining fixes the shapes "
                "stages send and receive when pipeline_stage builds them; build the stages "
                "again with an example micro-batch of the new shape, or pad the batch to the "
                "built one (the single-process PipelineRunner takes any shape the model takes)"
            )


def is_constant(value: Any) -> bool:
    """Whether ``value`` can be baked into an adapter: None, a number, a string, a
    dtype or device, or a tuple or list of them."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return True
    if isinstance(value, (tuple, list)):
        return all(is_constant(v) for v in value)
    return False


def memory_order(t: Any) -> tuple[int, ...] | None:
    """The dims of ``t`` from its outermost in memory to its innermost, where ``t`` fills
    its memory densely in another order than its own (a transpose's result): permuted so,
    it is contiguous without a copy. None for a tensor in its own order, or not dense."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.is_contiguous():
        return None
    strides = t.stride()
    order = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], d)))
    return order if t.permute(order).is_contiguous() else None


def wire_example(value: Any, order: tuple[int, ...] | None, device: torch.device
                 ) -> torch.Tensor:
    """An empty tensor as ``value`` travels (in ``order``): what torch allocates for it."""
    shape = value.shape if order is None else [value.shape[d] for d in order]
    out = torch.empty(shape, dtype=value.dtype, device=device)
    return out.requires_grad_(value.requires_grad)


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return tuple(inverse)


def _contiguous_grads(received: Sequence[torch.Tensor]) -> None:
    """Make the gradients of the received tensors contiguous, as torch sends them: its
    split backward takes them from ``autograd.grad`` as they come (a ``cat``'s backward
    gives slices). torch receives into the same buffers every step: one hook each."""
    for x in received:
        if x.requires_grad and x.is_leaf and not getattr(x, "_fxpipe_contiguous_grad", False):
            x.register_hook(torch.Tensor.contiguous)
            x._fxpipe_contiguous_grad = True  # type: ignore[attr-defined]


def _fake_state(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Every parameter and buffer name of ``module`` -> a fake of its tensor, one fake per
    tensor (a weight tied under two names stays tied for ``functional_call``)."""
    named = [*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False)]
    fakes: dict[int, torch.Tensor] = {}
    for _, t in named:
        if id(t) not in fakes:
            fakes[id(t)] = _fake_like(t, device)
    return {name: fakes[id(t)] for name, t in named}


def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # called inside FakeTensorMode: a fake tensor of t's shape on ``device``, whatever t's
    # device; a Parameter stays one (exported stages read theirs with get_parameter)
    if not isinstance(t, nn.Parameter) and not t.is_meta and t.numel() == 1:
        # a scalar buffer the forward may read as a number (BatchNorm's num_batches_tracked
        # with momentum=None): a fake that keeps its value, through in-place updates too
        out = torch.tensor(t.tolist(), dtype=t.dtype, device=device)
    else:
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out

