"""Recording a model's run layer by layer, to tell whether its repeated layers run alike.

A list of layers of one class and one structure (``layer_lists``) need not run alike:
a layer may read its index, or the model may read every layer's output. Before any of
them is copied (``repeats.py``), the whole model is run on fake tensors (static shapes,
about a second) recording, at the level of ``torch`` functions, every call with its
arguments (``record``): each tensor named by where it came from (this layer's call c,
the previous layer's call c, a parameter by its name inside the layer, anything else by
what it is), each other value as it is, with the grad mode and autocast state, and with
the flags export sets, so that the run takes the branches an export takes. The run gives
the shortest period and the first layer from which the layers repeat (``repeat_of``);
the model cut to a few layers per list (``cut``) is recorded too, and ``same_run`` says
whether it ran as the whole model's first layers and everything outside them, and every
later layer of the whole model as the exported layer of its phase.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from fxpipe.tracing.export import quiet_stderr

__all__ = ["FIRST", "Layers", "Repeat", "Run", "cut", "first_repeat", "layer_lists", "record",
           "repeat_of", "same_run", "worth_copying"]

MIN_LAYERS = 6  # shorter lists are exported whole: the copy would save too little
MAX_PERIOD = 8  # the longest period of layers that run alike looked for
# The most layers a list may start with that are built otherwise than the rest (dense
# feed-forward layers before the experts: DeepSeek-V3's first 3 of 61, GLM-4.5's first 3);
# they are exported, and so are the three after them, before any is copied
# (``first_repeat``).
MAX_UNLIKE = 4


@dataclass(frozen=True)
class Repeat:
    """How a list's layers repeat: ``depth`` layers are exported, and each later layer i
    is a copy of exported layer ``template(i)``, the one of its phase among the last
    ``period``."""

    depth: int
    period: int = 1

    def template(self, index: int) -> int:
        return self.depth - self.period + (index - self.depth) % self.period


FIRST = Repeat(2)  # exported while the whole model is recorded: the second layer copied


@dataclass(frozen=True)
class Layers:
    """One ``nn.ModuleList`` at ``path`` in the model whose layers from ``alike_from`` on
    are structurally identical (the ones before are built otherwise)."""

    path: str
    parent: torch.nn.Module
    attr: str
    modules: tuple[torch.nn.Module, ...]
    alike_from: int = 0


def layer_lists(model: torch.nn.Module) -> list[Layers]:
    """The outermost module lists of distinct layers that end in at least ``MIN_LAYERS``
    layers of one class with the same parameters and buffers (names, shapes, dtypes) and
    submodule classes, after at most ``MAX_UNLIKE`` others."""
    found: list[Layers] = []
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < MIN_LAYERS:
            continue
        if any(path.startswith(f"{outer.path}.") for outer in found):
            continue
        layers = tuple(module)
        if len({id(m) for m in layers}) < len(layers):
            continue
        structures = [_structure(m) for m in layers]
        alike_from = len(layers) - 1
        while alike_from > 0 and structures[alike_from - 1] == structures[-1]:
            alike_from -= 1
        if alike_from > MAX_UNLIKE or len(layers) - alike_from < MIN_LAYERS:
            continue
        owner, _, attr = path.rpartition(".")
        found.append(Layers(path, model.get_submodule(owner), attr, layers, alike_from))
    return found


def first_repeat(lists: Sequence[Layers]) -> Repeat:
    """The repeat tried first, while the whole model is recorded: ``FIRST``, two layers
    exported and the second copied; where a list starts with layers built otherwise, the
    first alike layer reads one of those, so it runs unlike the next: the two exported
    and compared are the two after it."""
    unlike = max(layers.alike_from for layers in lists)
    return Repeat(FIRST.depth + unlike + 1) if unlike else FIRST


def _structure(module: torch.nn.Module) -> tuple[Any, ...]:
    state = [
        (name, tuple(t.shape), t.dtype, t.requires_grad)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]
    kinds = [(name, type(m)) for name, m in module.named_modules()]
    return (tuple(state), tuple(kinds))


@contextmanager
def cut(lists: Sequence[Layers], depth: int) -> Iterator[None]:
    """Each list holds only its first ``depth`` layers inside the block; the model's own
    lists are put back after it."""
    originals = [getattr(layers.parent, layers.attr) for layers in lists]
    try:
        for layers in lists:
            setattr(layers.parent, layers.attr, torch.nn.ModuleList(layers.modules[:depth]))
        yield
    finally:
        for layers, original in zip(lists, originals, strict=True):
            setattr(layers.parent, layers.attr, original)


# What a run did, as the recorder saw it.
Call = tuple[Any, ...]


@dataclass
class Run:
    """The calls of one run: inside each layer (by list and index) and outside them all,
    and the order the layers ran in."""

    inside: dict[tuple[int, int], list[Call]] = field(default_factory=dict)
    outside: list[Call] = field(default_factory=list)
    order: list[tuple[int, int]] = field(default_factory=list)


class _Recorder(TorchFunctionMode):
    """Records every ``torch`` function call of a run (see the module docstring)."""

    def __init__(self, state: dict[int, str], inputs: dict[int, int], lists: Sequence[Layers],
                 lengths: Sequence[int]) -> None:
        super().__init__()
        self.state = state  # id(parameter or buffer) -> name
        self.lengths = lengths
        self.prefixes = [f"{layers.path}." for layers in lists]
        self.tokens: dict[int, tuple[Any, ...]] = {i: ("input", k) for i, k in inputs.items()}
        self.kept: list[Any] = []  # every recorded output, so that no id is reused
        self.where: list[tuple[int, int]] = []
        self.run = Run()

    def enter(self, which: tuple[int, int]) -> None:
        self.where.append(which)
        self.run.order.append(which)
        self.run.inside[which] = []

    def leave(self) -> None:
        self.where.pop()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        calls = self.run.inside[self.where[-1]] if self.where else self.run.outside
        call = (
            getattr(func, "__qualname__", repr(func)),
            self._value((args, kwargs)),
            torch.is_grad_enabled(),
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
        )
        index = len(calls)
        calls.append(call)
        out = func(*args, **kwargs)
        where = ("layer", *self.where[-1]) if self.where else ("outside",)
        for k, leaf in enumerate(pytree.tree_leaves(out)):
            if isinstance(leaf, torch.Tensor):
                self.tokens[id(leaf)] = (*where, index, k)
                self.kept.append(leaf)
        return out

    def _value(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, *(self._value(v) for v in value))
        if isinstance(value, dict):
            return ("dict", *((k, self._value(v)) for k, v in value.items()))
        if isinstance(value, slice):
            return ("slice", self._value(value.start), self._value(value.stop),
                    self._value(value.step))
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype,
                                               torch.device, torch.layout,
                                               torch.memory_format, type(...))):
            return value
        return ("object", repr(value))  # an id in the repr tells different objects apart

    def _tensor(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        name = self.state.get(id(tensor))
        if name is not None:
            return self._state(name)
        token = self.tokens.get(id(tensor))
        if token is None:  # made outside every call (a constant attribute): by identity
            self.kept.append(tensor)
            return ("tensor", id(tensor))
        if token[0] != "layer":
            return token
        _, which, index, call, k = token
        if self.where and self.where[-1][0] == which:
            here = self.where[-1][1]
            if index == here:
                return ("here", call, k)
            if index == here - 1:
                return ("previous", call, k)
        elif not self.where and index == self.lengths[which] - 1:
            return ("last", which, call, k)
        return token

    def _state(self, name: str) -> tuple[Any, ...]:
        if self.where:
            which, index = self.where[-1]
            prefix = f"{self.prefixes[which]}{index}."
            if name.startswith(prefix):
                return ("own", name[len(prefix):])
        return ("state", name)


def record(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
           lists: Sequence[Layers]) -> Run | None:
    """The calls of one forward on fake tensors with static shapes; None when the model
    cannot run that way (data-dependent Python control flow, say)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    live = [getattr(layers.parent, layers.attr) for layers in lists]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    fakes: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        if id(tensor) not in fakes:
            fakes[id(tensor)] = mode.from_tensor(tensor, static_shapes=True)
        state[name] = fakes[id(tensor)]
    fake_args, fake_kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: mode.from_tensor(t, static_shapes=True), (args, kwargs))
    inputs = {id(t): k for k, t in enumerate(pytree.tree_leaves((fake_args, fake_kwargs)))
              if isinstance(t, torch.Tensor)}
    names: dict[int, str] = {}
    for name, _ in named:
        names.setdefault(id(state[name]), name)
    recorder = _Recorder(names, inputs, lists, [len(m) for m in live])
    try:
        with _untouched(model), ExitStack() as hooks:
            for which, modules in enumerate(live):
                for index, module in enumerate(modules):
                    hooks.enter_context(_hooked(recorder, module, (which, index)))
            with quiet_stderr(), _as_exported(), mode, recorder:  # fake mode logs failures
                functional_call(model, state, fake_args, fake_kwargs, tie_weights=False)
    except Exception:
        return None
    return recorder.run


@contextmanager
def _as_exported() -> Iterator[None]:
    """The run takes the branches an export takes: ``torch.compiler.is_compiling()`` and
    ``is_exporting()`` are true inside (transformers then runs a mixture of experts'
    float32 ``grouped_mm`` through its fallback op, as the export does, where fake CPU
    tensors refuse the fused kernel)."""
    try:
        from torch._export.utils import _compiling_state_context
    except ImportError:  # an older torch: the flags as they are
        yield
        return
    with _compiling_state_context():
        yield


@contextmanager
def _untouched(model: torch.nn.Module) -> Iterator[None]:
    """The model's modules as they were before the block: a forward that caches a tensor
    on first use (``self.cos_cached = ...``, a buffer registered in forward) must not
    keep the fake one it made."""
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
             for m in model.modules()]
    try:
        yield
    finally:
        for module, attributes, parameters, buffers, modules in saved:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            for now, before in ((module._parameters, parameters), (module._buffers, buffers),
                                (module._modules, modules)):
                now.clear()
                now.update(before)  # type: ignore[arg-type]


@contextmanager
def _hooked(recorder: _Recorder, module: torch.nn.Module, which: tuple[int, int]
            ) -> Iterator[None]:
    before = module.register_forward_pre_hook(lambda *_: recorder.enter(which))
    after = module.register_forward_hook(lambda *_: recorder.leave(), always_call=True)
    try:
        yield
    finally:
        before.remove()
        after.remove()


def same_run(whole: Run, kept: Run, lists: Sequence[Layers], repeat: Repeat) -> bool:
    """Whether the model cut to ``repeat.depth`` layers per list ran as the whole model
    did, and every layer of the whole model after those as the exported layer of its
    phase."""
    depth = repeat.depth
    if whole.outside != kept.outside:
        return False
    if [w for w in whole.order if w[1] < depth] != kept.order:
        return False
    for which, layers in enumerate(lists):
        count = len(layers.modules)
        if [i for w, i in whole.order if w == which] != list(range(count)):
            return False
        if (count - depth) % repeat.period:  # the last layer must be a copy of the last
            return False
        if any(kept.inside[(which, i)] != whole.inside[(which, i)] for i in range(depth)):
            return False
        if any(whole.inside[(which, i)] != whole.inside[(which, repeat.template(i))]
               for i in range(depth, count)):
            return False
    return True


def repeat_of(whole: Run, lists: Sequence[Layers]) -> Repeat | None:
    """The fewest layers to export, and the shortest period, by which the whole model's
    recorded run says every list's later layers run as an exported one (``same_run``
    then checks the cut model); None when no period up to MAX_PERIOD leaves at least as
    many layers to copy as to export (``worth_copying``)."""
    counts = [len(layers.modules) for layers in lists]
    for period in range(1, MAX_PERIOD + 1):
        starts = [_periodic_from(whole, which, count, period)
                  for which, count in enumerate(counts)]
        depth = max(2 * period, *(start + period for start in starts))
        while depth < min(counts) and any((count - depth) % period for count in counts):
            depth += 1
        repeat = Repeat(depth, period)
        if worth_copying(repeat, lists) and not any((c - depth) % period for c in counts):
            return repeat
    return None


def worth_copying(repeat: Repeat, lists: Sequence[Layers]) -> bool:
    """Whether every list has at least as many layers to copy as ``repeat`` exports: an
    export of the cut model (and of a first try) costs more than a whole one otherwise
    (Gemma-2's six layers: 10.5 s exported four deep and copied, 5.7 s whole)."""
    return 2 * repeat.depth <= min(len(layers.modules) for layers in lists)


def _periodic_from(whole: Run, which: int, count: int, period: int) -> int:
    """The first layer of list ``which`` from which each layer runs as the one ``period``
    after it."""
    inside = [whole.inside.get((which, i)) for i in range(count)]
    start = count - period
    while start > 0 and inside[start - 1] == inside[start - 1 + period]:
        start -= 1
    return max(start, 0)
