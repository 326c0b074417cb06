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
import torch.fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

__all__ = ["MetaRunner", "inputs_to_meta", "named_state", "on_meta", "to_meta"]


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


def _device_to_meta(value: Any) -> Any:
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return to_meta(value)  # a constant the graph holds (a mask, a position table)
    return value


def _is_device_name(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return False
    return True


class MetaRunner(torch.fx.Interpreter):
    """Runs a graph on the meta device, whatever device the trace recorded.

    torch.export writes the tracing device into the graph (``aten.to(x, device=cpu)``,
    ``arange(..., device=cpu)``) and may hold constant tensors; both are mapped to
    meta, and ``.cpu()`` / ``.cuda()`` / ``.to("cpu")`` stay on meta.
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.meta_state: dict[str, torch.Tensor] = {}

    def run_on_meta(self, *flat_inputs: Any) -> Any:
        """Run once; grad mode is on inside and restored after, even on failure."""
        with torch.enable_grad(), on_meta(self.module) as state:
            self.meta_state = state  # qualified name -> the meta tensor standing in for it
            return self.run(*inputs_to_meta(flat_inputs))

    def fetch_args_kwargs_from_env(self, n: torch.fx.Node) -> tuple[Any, dict[str, Any]]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        args, kwargs = pytree.tree_map(_device_to_meta, (tuple(args), dict(kwargs)))
        if n.op == "call_method" and n.target == "to":
            args = tuple("meta" if _is_device_name(a) else a for a in args)
        if isinstance(kwargs.get("device"), str):
            kwargs["device"] = "meta"
        return args, kwargs

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return _device_to_meta(super().get_attr(target, args, kwargs))

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.higher_order.wrap_with_set_grad_enabled:
            # export's region under set_grad_enabled: its body is a graph of its own,
            # interpreted here so its device literals map to meta too.
            enabled, body, *inputs = args
            with torch.set_grad_enabled(enabled):
                return MetaRunner(body).run(*inputs)
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in ("cpu", "cuda") and isinstance(args[0], torch.Tensor):
            return args[0]
        return super().call_method(target, args, kwargs)
