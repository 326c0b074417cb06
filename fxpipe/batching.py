"""Which inputs of a model have a batch dimension: the runner splits those into
micro-batches along dim 0 and hands every other input whole to every micro-batch
(a causal mask shared by every sample, an HF-style ``position_ids`` of shape (1, T)).

# b: the example's batch size (one micro-batch), A: the inputs whose dim 0 is b.

The decision, per tensor leaf of the example inputs:

1. declared: the model file's ``batch_dims()`` says, per argument, 0 or None;
2. dim 0 differs from b: shared. b is the most common dim 0 among the tensors, or the
   first tensor's where the model runs with every tensor of that dim 0 one row bigger
   and every output follows (``forward(x, cos, sin)`` with cos and sin of another size);
3. among A, the smallest set that contains the first of them and lets the model run
   on the meta device when exactly that set gets batch b + 1 (every other input kept
   as it is), with no output left at b rows. The input of a batch norm that normalizes
   with batch statistics counts as an output here: its rows are the samples its running
   statistics take in, even where nothing reads its result. One run for a model whose inputs are all
   per sample; a shared input fails the run when it is resized, a per-sample one when
   it is not, or, processed on its own (a second tower), leaves its outputs at b rows.
   Where every set that runs leaves some output at b rows (an output that is not per
   sample), the smallest set that runs. With b == 1 a per-sample input left at 1 would
   broadcast, so when both answers run, fxpipe cannot tell and says so;
4. when the model does not run on the meta device at all (a data-dependent op), or with
   no set at b + 1 (a batch size fixed in its code), the inputs of A are taken as
   batched and the report says it was assumed.

The trial runs use meta tensors, or fake CPU tensors (``FakeTensorMode``) for a model
that makes a tensor of its own in forward (``torch.arange``), which meta ones cannot meet.
Neither checks an index against the size it indexes, so the trials do it for indices
counted by ``arange`` (``_IndexBounds``): Hugging Face's masks read a padding mask at
``arange(batch)``, and a mask left at b rows beside inputs of b + 1 ran, was taken for
one every sample shares, and gave each micro-batch the first one's padding.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.metadevice import on_meta, to_meta

__all__ = ["BatchDimsError", "InputBatching", "decide_batching"]

MAX_TRIALS = 64  # meta-device runs spent on telling shared from batched inputs
# logs a trial's expected failure (inputs that do not broadcast) at ERROR, with a traceback
FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"


class BatchDimsError(ValueError):
    """fxpipe cannot tell whether an input has a batch dimension, or ``batch_dims()``
    says something it cannot use."""


@dataclass(frozen=True)
class InputBatching:
    batched: frozenset[int]  # ids of the tensor leaves split into micro-batches
    how: str  # "declared", "traced with two batch sizes", "assumed" or "one input"


def decide_batching(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    declared: Any = None) -> InputBatching:
    """Which tensor leaves of ``(args, kwargs)`` are batched along dim 0 (see the module).

    The trials resize leaves by position, not by tensor: one tensor passed twice (a
    language model's ``model(idx, idx)``, its tokens as their own targets) is two inputs,
    each batched or not on its own."""
    leaves = _Leaves.of(args, kwargs)
    if declared is not None:
        batched = _declared(args, kwargs, declared)
        return InputBatching(leaves.ids(batched), "declared by batch_dims()")
    tensors = [i for i, t in enumerate(leaves.values)
               if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        return InputBatching(frozenset(), "no tensor inputs with a dimension")
    sizes = [leaves.rows(i) for i in tensors]
    if len(set(sizes)) == len(sizes):  # no other input of the first one's dim 0: no trial run
        return InputBatching(leaves.ids([tensors[0]]), "one input of the batch size")
    device = next((d for d in ("meta", "cpu") if _runs(model, leaves, frozenset(), 0, d)), None)
    b = _batch_size(model, leaves, tensors, device)
    same = [i for i in tensors if leaves.rows(i) == b]
    first, rest = same[0], same[1:]
    if not rest:
        return InputBatching(leaves.ids([first]), "one input of the batch size")
    if device is None:
        return InputBatching(leaves.ids(same),
                             "assumed (the model does not run on the meta device)")
    trials = 0
    smallest: tuple[int, list[frozenset[int]]] | None = None  # the first size that runs
    for size in range(len(rest) + 1):
        found, whole = [], []
        for extra in itertools.combinations(rest, size):
            trials += 1
            if trials > MAX_TRIALS:
                return InputBatching(leaves.ids(same),
                                     f"assumed (more than {MAX_TRIALS} trial runs)")
            chosen = frozenset([first, *extra])
            rows = _output_rows(model, leaves, chosen, b + 1, device)
            if rows is not None:
                found.append(chosen)
                if b not in rows:
                    whole.append(chosen)
        if smallest is None and found:
            smallest = size, found
        if whole:
            return _chosen(model, leaves, same, b, size, whole, device)
    if smallest is not None:  # an output of b rows whatever is resized: not per sample
        return _chosen(model, leaves, same, b, *smallest, device)
    # Nothing runs at b + 1 (a size fixed in the code): micro-batches of b samples still do.
    return InputBatching(leaves.ids(same), f"assumed (the model runs only with batch size {b})")


@dataclass(frozen=True)
class _Leaves:
    """The leaves of ``(args, kwargs)`` by position: ``values[i]``, named for people as
    ``names[i]`` (``argument 1``, ``'mask'``), and the tree to rebuild them into."""

    values: list[Any]
    names: list[str]
    spec: pytree.TreeSpec

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Leaves:
        values, spec = pytree.tree_flatten((args, kwargs))
        names = [f"argument {i}" for i, arg in enumerate(args)
                 for _ in pytree.tree_leaves(arg)]
        names += [repr(key) for key, arg in kwargs.items() for _ in pytree.tree_leaves(arg)]
        assert len(names) == len(values), (names, len(values))
        return cls(values, names, spec)

    def rows(self, i: int) -> int:
        return int(self.values[i].size(0))

    def ids(self, positions: Collection[int]) -> frozenset[int]:
        """The tensors at ``positions``, as ``InputBatching.batched`` holds them: one tensor
        at a batched position and at a shared one cannot be both, and is refused."""
        batched = {id(self.values[i]) for i in positions}
        for i, value in enumerate(self.values):
            if id(value) in batched and i not in positions and isinstance(value, torch.Tensor):
                other = next(j for j in positions if self.values[j] is value)
                raise BatchDimsError(
                    f"{self.names[other]} and {self.names[i]} are one tensor, but only "
                    f"{self.names[other]} has a batch dimension: pass {self.names[i]} a "
                    f"copy of its own (.clone()), or declare both in batch_dims()")
        return frozenset(batched)

    def rebuilt(self, leaf: Callable[[int, Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with leaf i replaced by ``leaf(i, values[i])``."""
        args, kwargs = pytree.tree_unflatten(
            [leaf(i, value) for i, value in enumerate(self.values)], self.spec)
        return args, kwargs


def _batch_size(model: torch.nn.Module, leaves: _Leaves, tensors: list[int],
                device: str | None) -> int:
    """b: the most common dim 0, or the first input's where they differ and the model runs
    with every input of that dim 0 one row bigger and no output left behind (x first, then
    two shared tables of another size: a rotary embedding's cos and sin)."""
    most = Counter(leaves.rows(i) for i in tensors).most_common(1)[0][0]
    lead = leaves.rows(tensors[0])
    if lead != most and device is not None:
        rows = _output_rows(model, leaves, frozenset(
            i for i in tensors if leaves.rows(i) == lead), lead + 1, device)
        if rows is not None and lead not in rows:
            return lead
    return most


def _chosen(model: torch.nn.Module, leaves: _Leaves, same: list[int], b: int, size: int,
            found: list[frozenset[int]], device: str | None) -> InputBatching:
    """The one set of ``size`` + 1 inputs in ``found``; more than one, or (with b == 1,
    where an input left at one sample broadcasts) a bigger set that runs too: ambiguous."""
    if len(found) > 1 or (b == 1 and size < len(same) - 1
                          and _output_rows(model, leaves, frozenset(same), b + 1, device)
                          is not None):
        raise BatchDimsError(_ambiguous(leaves, same, b))
    return InputBatching(leaves.ids(found[0]), f"traced with batch sizes {b} and {b + 1}")


def _runs(model: torch.nn.Module, leaves: _Leaves, resized: frozenset[int], size: int,
          device: str | None) -> bool:
    """Whether ``model`` runs on storage-less tensors with the leaves at the positions
    ``resized`` given ``size`` rows along dim 0 and every other leaf as it is."""
    return _output_rows(model, leaves, resized, size, device) is not None


def _output_rows(model: torch.nn.Module, leaves: _Leaves, resized: frozenset[int], size: int,
                 device: str | None) -> set[int] | None:
    """Run as ``_runs`` does: None if the model fails, else dim 0 of every output tensor
    with a dimension. An input processed on its own (a second tower returned as an output
    of its own) runs at any size; an output still at the old batch size gives it away.

    ``device``: "meta", or "cpu" for fake CPU tensors (``FakeTensorMode``), where a
    forward that makes a tensor of its own (``x + torch.arange(n)``) runs too."""
    if device is None:
        return None

    def storageless(i: int, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if i in resized:
            return torch.empty((size, *t.shape[1:]), dtype=t.dtype, device=device)
        return to_meta(t, device=device)

    statistics = _BatchStatistics()
    try:
        with (FakeTensorMode() if device == "cpu" else contextlib.nullcontext()), \
                torch.no_grad(), on_meta(model, device=device), statistics, _IndexBounds(), \
                _quiet(FAKE_TENSOR_LOG):
            fake_args, fake_kwargs = leaves.rebuilt(storageless)
            output = model(*fake_args, **fake_kwargs)
    except Exception:
        return None
    return {int(t.size(0)) for t in pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.dim() > 0} | statistics.rows


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Logger ``name`` silent inside: a trial that fails is an answer, not an error."""
    logger = logging.getLogger(name)
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


class _BatchStatistics(TorchFunctionMode):
    """Notes dim 0 of every batch norm's input normalized with batch statistics (training
    mode, or no running statistics): the samples it mixes, and those its running mean and
    variance take in, must be one micro-batch's, as the rows of an output must."""

    # batch_norm(input, ...) with ``training`` sixth, in both spellings
    FUNCTIONS = (torch.nn.functional.batch_norm, torch.batch_norm)

    def __init__(self) -> None:
        super().__init__()
        self.rows: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.FUNCTIONS:
            value = args[0] if args else kwargs.get("input")
            training = kwargs.get("training", args[5] if len(args) > 5 else False)
            if training and isinstance(value, torch.Tensor) and value.dim() > 0:
                self.rows.add(int(value.size(0)))
        return func(*args, **kwargs)


_aten = torch.ops.aten
# ops whose output holds exactly its input's values (laid out otherwise): the highest
# index counted by an arange stays the highest through them
_SAME_VALUES = frozenset({
    _aten.unsqueeze, _aten.view, _aten._unsafe_view, _aten.reshape, _aten.expand,
    _aten.alias, _aten.clone, _aten._to_copy, _aten.permute, _aten.transpose, _aten.t,
    _aten.squeeze, _aten.detach, _aten.contiguous, _aten.lift_fresh})


class _IndexBounds(TorchDispatchMode):
    """Fails an index op that reads past the end of a dim with an index counted by
    ``arange`` (kept through ops that only lay its values out otherwise, or add a number),
    as a real tensor would and a meta or fake one does not."""

    def __init__(self) -> None:
        super().__init__()
        self.highest: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, its top)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        reads = (enumerate(args[1]) if packet is _aten.index and len(args) > 1 else
                 [(args[1], args[2])] if packet is _aten.index_select and len(args) > 2 else [])
        for dim, index in reads:
            top = self._top(index)
            if top is not None and top >= args[0].size(dim):
                raise IndexError(f"index {top} is out of bounds for dim {dim} with size "
                                 f"{args[0].size(dim)}")
        output = func(*args, **kwargs)
        top = self._made(packet, args, kwargs)
        if top is not None and isinstance(output, torch.Tensor):
            self.highest[id(output)] = (output, top)
        return output

    def _top(self, value: Any) -> int | None:
        # the tensors are held, so an id seen here is theirs alone
        held = self.highest.get(id(value))
        return None if held is None else held[1]

    def _made(self, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The highest value of the output of ``packet(*args)``, where it is known."""
        if packet is _aten.arange:  # (end), (start, end) or (start, end, step)
            bounds = [*args, *(kwargs[k] for k in ("start", "end", "step") if k in kwargs)][:3]
            if not bounds or not all(isinstance(n, int) for n in bounds):
                return None
            counted = range(*bounds)
            return max(counted[0], counted[-1]) if counted else None
        top = self._top(args[0]) if args else None
        if top is None:
            return None
        if packet in _SAME_VALUES:
            return top
        if packet is _aten.add and len(args) > 1 and isinstance(args[1], int):
            return top + args[1]
        return None


def _ambiguous(leaves: _Leaves, same: Sequence[int], b: int) -> str:
    listed = ", ".join(f"{leaves.names[i]} {tuple(leaves.values[i].shape)}" for i in same)
    return (
        f"cannot tell which inputs have a batch dimension: {listed} have dim 0 of size "
        f"{b} and the model runs with more than one choice of them batched; define "
        f"batch_dims() in the model file, returning per argument 0 (split along dim 0) or "
        f"None (shared by every sample), e.g. (0, None)"
        + ("" if b > 1 else ", or give example_inputs() a batch of at least 2 samples")
    )


def _declared(args: tuple[Any, ...], kwargs: dict[str, Any], declared: Any) -> frozenset[int]:
    """The positions of the leaves of ``(args, kwargs)`` that ``batch_dims()`` (a tuple per
    positional argument, a dict per keyword argument, or both as ``(tuple, dict)``) marks
    with dim 0."""
    if isinstance(declared, Mapping):
        positional, keyword = (), dict(declared)
    elif (isinstance(declared, tuple) and len(declared) == 2
          and isinstance(declared[0], tuple | list) and isinstance(declared[1], Mapping)):
        positional, keyword = tuple(declared[0]), dict(declared[1])
    elif isinstance(declared, tuple | list):
        positional, keyword = tuple(declared), {}
    else:
        raise BatchDimsError(
            f"batch_dims() returned {type(declared).__name__}; return a tuple (one entry "
            f"per positional argument) or a dict (per keyword argument) of 0 or None"
        )
    if len(positional) != len(args) or set(keyword) != set(kwargs):
        raise BatchDimsError(
            f"batch_dims() gives {len(positional)} positional entries and keywords "
            f"{sorted(keyword)}, but example_inputs() has {len(args)} positional arguments "
            f"and keywords {sorted(kwargs)}; give one entry (0 or None) per argument"
        )
    batched: set[int] = set()
    entries = [*zip(positional, args, strict=True),
               *((keyword[key], value) for key, value in kwargs.items())]
    position = 0  # of the argument's first leaf among the leaves of (args, kwargs)
    for dim, value in entries:
        if dim not in (0, None):
            raise BatchDimsError(
                f"batch_dims() gives {dim!r} for an argument; fxpipe splits micro-batches "
                f"along dim 0 only: use 0 (batched) or None (shared); move the batch "
                f"dimension first in the model's inputs"
            )
        for t in pytree.tree_leaves(value):
            if dim == 0 and isinstance(t, torch.Tensor) and t.dim() > 0:
                batched.add(position)
            position += 1
    return frozenset(batched)
