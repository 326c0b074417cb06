"""Re-materialization without side effects: a recomputed forward replays the random
numbers (dropout masks) its first run drew, so its outputs and gradients match, and
whatever it writes into buffers (BatchNorm's running statistics, a counter updated in
place) is undone, so buffers change once per micro-batch, as without recompute.

A recomputed stage's first run is the run again's twin: with grad, as the model runs it
and as it runs again in the backward, since some kernels depend on it (on the CPU,
attention with a mask that needs a gradient takes the math path, without grad the fused
kernel: in bfloat16, values far apart, which the next stage would have read while the
backward differentiated the others). It saves no tensor for the backward
(``nothing_saved``); its outputs are passed on without their graph, each still saying
whether it needs a gradient (``passed_on``).

A stage recomputes in one of three ways, named as the plan names them (``MODES``, in
words in recompute_modes.py): ``"none"`` keeps what its backward needs for every
micro-batch in flight; ``"full"`` keeps only what it receives and runs its whole forward
again in the backward; ``"selective"`` (selective activation checkpointing, torch's SAC)
also keeps the outputs of the matrix multiplications and the fused attention kernels
(``SELECTIVE_KEEPS``) and runs only the other ops again, which are cheap for their bytes.
A selective stage may keep only some of those outputs, the ones that cost the most to run
again for their bytes, by a ``KeepRule`` its mode names (``"selective:W:N"``, its
``str``). The planner prices a
selective stage from the same op list and rule (fxpipe.passes.memory), so what it plans is
what ``selective_contexts`` keeps. SAC keeps those outputs as they are, so an op that writes
into one in place would hand the backward the written value: ``KeptWrites`` sees such
writes, the planner to leave those outputs out of every rule (``KeepRule.skip``), the
runtime to refuse a write into one its rule keeps."""

import contextlib
import inspect
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .recompute_modes import KEEP_ALL, MODES, KeepRule, keep_rule, mode_name, modes

# The modes and the keep rule, in words, are recompute_modes.py's; named here too for the
# modules that run them.
__all__ = ["KEEP_ALL", "MODES", "SELECTIVE_KEEPS", "EachTime", "KeepRule", "Kept", "KeptWrites",
           "RngState", "buffers_restored", "keep_rule", "keeping", "mode_name", "modes",
           "nothing_saved", "passed_on", "refuse_split_backward", "rng_restored", "rng_state",
           "selective_contexts", "selective_run", "work_and_width"]

aten = torch.ops.aten
# The aten ops whose outputs a selective stage keeps: the matrix multiplications and the
# fused attention kernels (each kernel torch has; older torch lacks some).
SELECTIVE_KEEPS = frozenset(
    getattr(aten, name) for name in (
        "mm", "addmm", "bmm", "baddbmm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    ) if hasattr(aten, name))

_ATTENTION = frozenset(op for op in SELECTIVE_KEEPS if "attention" in op.__name__)

RngState = tuple[torch.Tensor, torch.Tensor | None]  # (CPU state, CUDA state of the device)


def work_and_width(op: Any, args: Sequence[Any]) -> tuple[int, int]:
    """(FLOPs per output element, output columns) of a call of an op of ``SELECTIVE_KEEPS``:
    a matmul does 2 k (k the length it sums over), attention 4 times the keys' length (the
    scores and the weighted sum). A kept output's bytes cost this work to run again: the
    more work per element, the more a byte of it is worth keeping."""
    if op.overloadpacket in _ATTENTION:
        _query, key, value = args[:3]
        return 4 * key.shape[-2], value.shape[-1]
    left, right = args[-2:]  # mm, bmm (a, b); addmm, baddbmm (bias, a, b)
    return 2 * left.shape[-1], right.shape[-1]


def refuse_split_backward(modes: Iterable[str], schedule: str, fix: str) -> None:
    """ValueError where a stage of ``modes`` recomputes selectively under ``schedule``,
    which runs each stage's backward in two passes (torch's SAC runs a region's backward
    once); ``fix`` says what to do instead, as its caller's user would do it."""
    if any(mode_name(mode) == "selective" for mode in modes):
        raise ValueError(f"{schedule} runs each stage's backward in two passes, which "
                         f"selective recompute cannot: {fix}")


def rng_state(dev: torch.device | None) -> RngState:
    """The CPU random state, and ``dev``'s when it is a GPU."""
    cuda_state = None
    if dev is not None and dev.type == "cuda":
        cuda_state = torch.cuda.get_rng_state(dev)
    return torch.get_rng_state(), cuda_state


@contextlib.contextmanager
def rng_restored(dev: torch.device | None, rng: Any) -> Iterator[None]:
    """Run with the random state ``rng`` taken on ``dev``, restoring the current one after."""
    cuda_devices = [dev] if dev is not None and dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        cpu_state, cuda_state = rng
        torch.set_rng_state(cpu_state)
        if cuda_state is not None and dev is not None:
            torch.cuda.set_rng_state(cuda_state, dev)
        yield


@contextlib.contextmanager
def buffers_restored(stage: nn.Module, k: int,
                     bound: Mapping[tuple[int, int], Mapping[str, torch.Tensor]]
                     ) -> Iterator[None]:
    """Run, then put every buffer that stage ``k`` may write back to its value before the
    run: the stage's own (or the copies bound in their place on its device) and those
    ``bound`` for its replicas on other devices (see placement.py).

    The block must include the backward of the recomputed forward: a buffer that the
    forward both updated in place and saved for backward keeps the updated value
    until autograd has read it, and only then is restored (in place, so every module
    and copy that holds the tensor sees it). The restore leaves the buffer's version
    counter alone, as BatchNorm's own update of its running statistics does: a zero-bubble
    schedule's weight gradient (W) runs after the block on a graph that saved them."""
    buffers = list(stage.buffers())
    for (j, _i), tensors in bound.items():
        if j == k:
            buffers += [t for t in tensors.values() if not isinstance(t, nn.Parameter)]
    unique = {id(t): t for t in buffers}
    saved = [(t, t.detach().clone()) for t in unique.values()]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, before in saved:
                t.data.copy_(before)  # .data: a write autograd does not count


def nothing_saved() -> contextlib.AbstractContextManager[None]:
    """While open, autograd saves no tensor for the backward: a forward with grad that keeps
    only its graph's nodes, for a backward that never runs."""

    def never(_: None) -> torch.Tensor:
        raise RuntimeError("a recomputed stage's first run has no backward; it runs again")

    return torch.autograd.graph.saved_tensors_hooks(lambda _: None, never)


def passed_on(outputs: Any) -> Any:
    """A first run's outputs as later stages read them: without their graph, each tensor
    a leaf that requires grad where the output did (a detached value needs none)."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), outputs)


class EachTime:
    """A context manager that enters a fresh ``make()`` each time it is entered (checkpoint
    enters the run again's context once per backward pass over the stage)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.entered: list[Any] = []

    def __enter__(self) -> Any:
        context = self.make()
        self.entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.entered.pop().__exit__(*exc)


def keeping(rule: KeepRule) -> Callable[..., CheckpointPolicy]:
    """SAC's policy for a selective stage: keep the outputs of the ``SELECTIVE_KEEPS``
    calls ``rule`` keeps, run the rest again."""

    def policy(_ctx: Any, op: Any, *args: Any, **_kwargs: Any) -> CheckpointPolicy:
        if op.overloadpacket in SELECTIVE_KEEPS and rule.keeps(*work_and_width(op, args)):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class Kept(NamedTuple):
    """An output of a ``SELECTIVE_KEEPS`` call: its ``work_and_width`` and bytes."""

    work: int
    width: int
    nbytes: int


class KeptWrites(TorchDispatchMode):
    """While open: the storages of the outputs of ``SELECTIVE_KEEPS`` calls that ``rule``
    keeps (``added``: those first seen since it was last emptied, as ``Kept``), and
    ``on_write(op, (work, width))`` called for each op that writes into one in place,
    with the (``work_and_width``) of the call whose output it writes.

    Its bookkeeping of one call is ``written`` (before the call runs) and ``made`` (after):
    the dispatch mode calls both on every op; a SAC policy that sees each op's output can
    call them itself (``selective_contexts``), with no second mode to dispatch through."""

    def __init__(self, on_write: Callable[[Any, tuple[int, int]], None],
                 rule: KeepRule = KEEP_ALL) -> None:
        super().__init__()
        self.on_write = on_write
        self.rule = rule
        self.added: list[Kept] = []
        # by storage: (its reference, the work and width of the call that made it); a dead
        # one's number may be reused
        self._kept: dict[int, tuple[StorageWeakRef, tuple[int, int]]] = {}

    def _made(self, t: torch.Tensor) -> tuple[int, int] | None:
        """The work and width of the kept call whose output ``t``'s storage is; None."""
        held = self._kept.get(StorageWeakRef(t.untyped_storage()).cdata)
        return held[1] if held is not None and not held[0].expired() else None

    def written(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """``on_write`` for each kept output the call ``func(*args, **kwargs)`` writes."""
        if func._schema.is_mutable:
            for made in {self._made(t) for t in _written(func, args, kwargs)} - {None}:
                assert made is not None
                self.on_write(func, made)

    def made(self, func: Any, args: Sequence[Any], result: Any) -> bool:
        """Whether ``rule`` keeps the output ``result`` of the call of ``func`` on
        ``args``; if so, its storages are recorded (``added``, for those not seen before)."""
        if func.overloadpacket not in SELECTIVE_KEEPS:
            return False
        made = work_and_width(func, args)
        if not self.rule.keeps(*made):
            return False
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and self._made(t) is None:
                ref = StorageWeakRef(t.untyped_storage())
                self._kept[ref.cdata] = (ref, made)
                self.added.append(Kept(*made, t.untyped_storage().nbytes()))
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.written(func, args, kwargs)
        result = func(*args, **kwargs)
        self.made(func, args, result)
        return result


def _written(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors the aten op ``func`` writes in place: its schema's written arguments."""
    out: list[torch.Tensor] = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            out += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


def _refuse_write(func: Any, _made: tuple[int, int]) -> None:
    raise RuntimeError(
        f"{func} writes in place into the output of a matmul or attention that selective "
        f"recompute keeps, which the backward would then read written: recompute this "
        f"stage in full, not at all, or by a rule that does not keep it (fxpipe's plans "
        f"keep no output the model writes)")


def selective_contexts(restored: Callable[[], contextlib.AbstractContextManager[Any]],
                       rule: KeepRule = KEEP_ALL) -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` result for a selective stage: (the first
    run's context, which keeps the outputs of ``SELECTIVE_KEEPS`` that ``rule`` keeps and
    refuses a write into one of those; the run again's, which reads them back and, each time, runs
    inside ``restored()``, which undoes what it writes into buffers).

    Every op of the first run passes through SAC's dispatch mode, which costs the host tens
    of microseconds a call (bench/sac_overhead.py). Where torch hands the policy each op's
    output (``SelectiveCheckpointContext.op_output``, torch 2.13), the policy watches for the
    writes itself; an older torch's policy runs before the op, so a mode of its own watches."""
    if _POLICY_SEES_OUTPUT:
        watch = KeptWrites(_refuse_write, rule)

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            watch.written(op, args, kwargs)
            if watch.made(op, args, ctx.op_output):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        keep, again = create_selective_checkpoint_contexts(policy)
        first: Any = keep
    else:
        keep, again = create_selective_checkpoint_contexts(keeping(rule))
        first = _watched(keep, KeptWrites(_refuse_write, rule))

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with restored(), again:  # the restore's own copies outside what SAC replays
            yield

    return first, EachTime(both)


# torch 2.13's SAC asks the policy once per op, after running it, and hands it the output
_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


@contextlib.contextmanager
def _watched(keep: Any, watch: KeptWrites) -> Iterator[None]:
    with keep, watch:  # the watch inside: it sees each op first
        yield


def selective_run(run: Callable[..., Any], inputs: dict[str, Any], rule: KeepRule,
                  writes: Collection[str],
                  restored: Callable[[], contextlib.AbstractContextManager[Any]]) -> Any:
    """``run(**inputs)`` under torch's SAC (``selective_contexts``, keeping by ``rule``).
    Its run again in the backward must start from the inputs as received: an input it
    writes in place (named in ``writes``) is given to both runs as a copy taken first,
    each run writes a copy of that, and the first run's is written into the input, as
    ``run`` would have."""

    def copied(**given: Any) -> tuple[Any, tuple[Any, ...]]:
        given.update((name, given[name].clone()) for name in written)
        return run(**given), tuple(given[name] for name in written)

    written = sorted(inputs.keys() & writes)
    received = {**inputs, **{name: inputs[name].clone() for name in written}}
    outputs, after = checkpoint(copied, use_reentrant=False,
                                context_fn=lambda: selective_contexts(restored, rule), **received)
    for name, value in zip(written, after, strict=True):
        inputs[name].copy_(value)
    return outputs
