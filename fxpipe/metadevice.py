"""Running a graph on the ``meta`` device: shapes, FLOPs and autograd without storage.

Analyses swap every parameter and buffer of the module for a meta tensor of the
same shape, dtype and ``requires_grad`` for the duration of a run, so a 70B
model is analysed on a laptop and a real model is never touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

__all__ = ["inputs_to_meta", "named_state", "on_meta", "to_meta"]


def to_meta(tensor: torch.Tensor) -> torch.Tensor:
    """A storage-less copy of ``tensor`` on the meta device, ``requires_grad`` kept."""
    copy = torch.empty_like(tensor, device="meta")
    return copy.requires_grad_(tensor.requires_grad) if copy.is_floating_point() else copy


def named_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (tied ones repeated)."""
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    named += module.named_buffers(remove_duplicate=False)
    return named


@contextmanager
def on_meta(module: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Swap the module's state for meta tensors; yields name -> meta tensor.

    Tied parameters stay tied: one meta tensor serves every name of one original.
    """
    by_identity: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in named_state(module):
        if id(tensor) not in by_identity:
            by_identity[id(tensor)] = to_meta(tensor)
        state[name] = by_identity[id(tensor)]
    with _reparametrize_module(module, state, tie_weights=True):
        yield state


def inputs_to_meta(values: Any) -> Any:
    """Every tensor leaf of ``values`` moved to meta (requires_grad kept)."""
    return pytree.tree_map_only(torch.Tensor, to_meta, values)
