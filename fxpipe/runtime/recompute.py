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
whether it needs a gradient (``passed_on``)."""

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["RngState", "buffers_restored", "nothing_saved", "passed_on", "rng_restored",
           "rng_state"]

RngState = tuple[torch.Tensor, torch.Tensor | None]  # (CPU state, CUDA state of the device)


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
    ``bound`` for its replicas on other devices (see devices.py).

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
