"""Random state for re-materialization: a recomputed forward replays the random
numbers (dropout masks) its first run drew, so its outputs and gradients match."""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["RngState", "rng_restored", "rng_state"]

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
