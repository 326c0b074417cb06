"""The values of a pipeline step: which stage makes and reads each, and what a
step keeps per micro-batch.

How a step moves data::

    values[m]: name -> value          (graph inputs, split along dim 0, and every
         │                              stage output of micro-batch m)
         ├─► F(k, m): inputs = detached leaves of values[m][name] for name in INPUTS,
         │            requires_grad copied from the producer; outputs -> values[m]
         │            (k = K - 1: loss_m = loss_fn(build_output(values[m]), target_m) / M)
         └─◄ B(k, m): torch.autograd.backward(outputs that require grad, their grads)
                      (k = K - 1: the loss); the grads of k's input leaves, as
                      autograd hands them over (``received_grads``), are added to
                      grads[m][name] of the producer, summed over consumers
"""

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .stashing import Stash, WeightStashes
from .stream import Streams

__all__ = ["GRAPH_INPUT", "OnDemand", "StepState", "Wiring", "receive", "received_grads",
           "received_leaves", "sum_grads"]

GRAPH_INPUT = -1  # producer index of a value that comes from the caller


class Wiring:
    """Each stage's INPUTS and OUTPUTS names, and the stage that produces each value;
    checks that every value has one producer, earlier than its readers. ``written``:
    the graph inputs some stage writes in place (its optional WRITES)."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        self.inputs: list[tuple[str, ...]] = []
        self.outputs: list[tuple[str, ...]] = []
        self.producer: dict[str, int] = {}
        self.written = frozenset(name for stage in stages for name in getattr(stage, "WRITES", ()))
        # values each stage receives or sends that have no batch dim (optional UNBATCHED)
        self.unbatched = [frozenset(getattr(stage, "UNBATCHED", ())) for stage in stages]
        for k, stage in enumerate(stages):
            try:
                ins = tuple(getattr(stage, "INPUTS"))  # noqa: B009 (class attributes, not Tensors)
                outs = tuple(getattr(stage, "OUTPUTS"))  # noqa: B009
            except AttributeError:
                raise TypeError(
                    f"stage {k} ({type(stage).__name__}) has no INPUTS/OUTPUTS class "
                    f"attributes: stages must name the values they read and produce"
                ) from None
            self.inputs.append(ins)
            self.outputs.append(outs)
            for name in outs:
                if name in self.producer:
                    raise ValueError(
                        f"value {name!r} is produced by stage {self.producer[name]} and "
                        f"stage {k}: every value must have one producer"
                    )
                self.producer[name] = k
        for k, ins in enumerate(self.inputs):
            for name in ins:
                p = self.producer_of(name)
                if p >= k:
                    raise ValueError(
                        f"stage {k} reads {name!r}, produced by stage {p}: a stage can only "
                        f"read values of earlier stages or graph inputs"
                    )

    def producer_of(self, name: str) -> int:
        return self.producer.get(name, GRAPH_INPUT)

    def received(self, k: int, name: str) -> bool:
        """Whether stage k reads ``name`` from another stage (not a graph input)."""
        return self.producer_of(name) not in (GRAPH_INPUT, k)

    def check_outputs(self, k: int, outputs: Any) -> None:
        """What stage k returned must be a tuple of its OUTPUTS."""
        expected = self.outputs[k]
        if not isinstance(outputs, tuple) or len(outputs) != len(expected):
            got = f"a tuple of {len(outputs)}" if isinstance(outputs, tuple) else type(outputs)
            raise TypeError(
                f"stage {k} returned {got}, expected a tuple of its {len(expected)} "
                f"OUTPUTS {expected}"
            )


class OnDemand(dict[str, Any]):
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


class StepState:
    """Everything one ``step`` keeps per micro-batch."""

    def __init__(self, values: list[dict[str, Any]], targets: list[Any],
                 loss_fn: Callable[[Any, Any], torch.Tensor], batch: list[int | None],
                 stashes: WeightStashes | None) -> None:
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
        self.stashes = stashes  # weight stashing's versions, None without it
        # (k, m) -> (what I(k, m) differentiated, their gradients): the graph its W runs on
        self.deferred: dict[tuple[int, int], tuple[list[torch.Tensor],
                                                   list[torch.Tensor | None]]] = {}


def receive(streams: Streams, value: Any, producer: int, k: int, event: Any, grad: bool) -> Any:
    """``value`` (made by ``producer``, -1 for a graph input) as stage k sees it:
    on k's device, ordered after ``event``; stage outputs become detached leaves
    with the producer's requires_grad when ``grad`` (a recomputed producer passes
    its outputs on as such leaves already, see recompute.py)."""
    leaves, spec = pytree.tree_flatten(value)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        return value
    dev = streams.device(k)
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if producer != GRAPH_INPUT:
                x = streams.move(x, producer, k, event)
                if grad:
                    x = x.detach().requires_grad_(x.requires_grad)
            elif dev is not None and x.device != dev:
                x = x.to(dev)  # a graph input: differentiable, on k's stream
        out.append(x)
    return pytree.tree_unflatten(out, spec)


def sum_grads(contributions: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None] | None:
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


def received_leaves(wiring: Wiring, k: int, named: Iterable[tuple[str, Any]]
                    ) -> list[torch.Tensor]:
    """The tensors among ``named`` (stage k's values by name) that k received from another
    stage and that need a gradient: the ones whose gradients k sends back."""
    return [x for name, value in named if wiring.received(k, name)
            for x in pytree.tree_leaves(value)
            if isinstance(x, torch.Tensor) and x.requires_grad]


@contextlib.contextmanager
def received_grads(wiring: Wiring, k: int, inputs: Mapping[str, Any]
                   ) -> Iterator[Callable[[Any], torch.Tensor | None]]:
    """Around stage k's backward: the gradient of a leaf of ``inputs`` (its values by
    name) as autograd handed it over, for the leaves received from another stage, else
    its ``.grad`` (None for what is not a tensor). A leaf's ``.grad`` is laid out like the
    leaf (autograd's layout contract), a transposed received value's gradient transposed
    too, where the model passes it on as the reading op's backward made it; sent as it
    came, the producer's backward reduces it in the model's order and rounds as the model
    does (a float32 sum inside a float64 model differed by 1e-7 otherwise)."""
    got: dict[int, torch.Tensor] = {}

    def keeper(key: int) -> Callable[[torch.Tensor], None]:
        def keep(grad: torch.Tensor) -> None:
            got[key] = grad
        return keep

    def grad_of(x: Any) -> torch.Tensor | None:
        return got.get(id(x), x.grad) if isinstance(x, torch.Tensor) else None

    handles = [x.register_hook(keeper(id(x)))
               for x in received_leaves(wiring, k, inputs.items())]
    try:
        yield grad_of
    finally:
        for handle in handles:
            handle.remove()
