"""Backward hooks, as a trace meets them.

A backward hook reads or changes the gradient flowing through a module or a tensor
(gradient reversal, clipping, masking, per-sample gradients). No tracer records one: it
runs in the stages only where a stage calls what it hangs on.

- A module's own backward hooks (``register_full_backward_hook``,
  ``register_full_backward_pre_hook``, ``register_backward_hook``) fire where a stage
  calls the module itself. ``symbolic_trace`` keeps such a module as one call
  (``HookedLeaves``), so they run as in the model; ``torch.export`` inlines every module,
  so they do not.
- Hooks registered for every module (``register_module_full_backward_hook``) fire only
  around the modules a stage calls as a whole.
- A hook that forward registers on a tensor it computes (``x.register_hook``) is never
  recorded (``tensor_hooks`` finds them).

Parameters' hooks are not among these: the stages train the model's own parameters, so
``p.register_hook`` and ``register_post_accumulate_grad_hook`` fire as in the model.
What does not run is named in a note by ``dropped``, with what to do instead.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.nn.modules import module as module_hooks

__all__ = ["HookedLeaves", "backward_hooked", "dropped", "tensor_hooks"]

_TORCH = str(Path(torch.__file__).parent)


def backward_hooked(module: torch.nn.Module) -> bool:
    """Whether ``module`` has backward hooks of its own."""
    return bool(module._backward_hooks or module._backward_pre_hooks)


class HookedLeaves(torch.fx.Tracer):
    """``symbolic_trace``'s tracer, keeping each module with backward hooks as one call,
    where the stage that calls it runs them."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return backward_hooked(m) or super().is_leaf_module(m, module_qualified_name)


@contextlib.contextmanager
def tensor_hooks() -> Iterator[list[str]]:
    """While open, where the model's code registers a hook on a tensor (``file:line``,
    once each) is appended to the list it yields; torch's own registrations are not."""
    sites: list[str] = []
    before = torch.Tensor.register_hook

    def register_hook(self: torch.Tensor, hook: Any) -> Any:
        caller = sys._getframe(1)
        if not caller.f_code.co_filename.startswith(_TORCH):
            site = f"{caller.f_code.co_filename}:{caller.f_lineno}"
            if site not in sites:
                sites.append(site)
        return before(self, hook)

    torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
    try:
        yield sites
    finally:
        torch.Tensor.register_hook = before  # type: ignore[method-assign]


def dropped(model: torch.nn.Module, gm: torch.fx.GraphModule, sites: list[str]) -> list[str]:
    """The notes for the backward hooks of ``model`` that the stages of ``gm`` do not run
    (see the module docstring); ``sites``: where forward registered tensor hooks."""
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    modules = [path or type(model).__name__ for path, m in model.named_modules()
               if backward_hooked(m) and path not in called]
    notes = []
    if modules:
        notes.append(
            f"the backward hooks of {_listed(modules)} do not run in the stages, which "
            f"inline {'it' if len(modules) == 1 else 'them'} (torch.export does; "
            f"symbolic_trace keeps a hooked module of the model's as one call): the "
            f"pipeline's gradients are not the model's where a hook changes them; make "
            f"the change in a torch.autograd.Function, which both tracers keep")
    if module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks:
        notes.append(
            "backward hooks registered for every module run only around the modules "
            "the stages call as a whole, not the ones they inline")
    if sites:
        notes.append(
            f"forward registers a hook on a tensor it computes ({_listed(sites)}), which "
            f"no tracer records: it does not run in the stages, and the pipeline's "
            f"gradients are not the model's where it changes them; make the change in "
            f"a torch.autograd.Function, which both tracers keep")
    return notes


def _listed(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
