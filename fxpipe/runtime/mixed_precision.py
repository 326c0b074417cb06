"""Training at the plan's precision (Lightning's names), as the plan counted it.

    32-true, 64-true   the model as it is
    bf16-true, 16-true the model and the floating-point inputs in that dtype; the user
                       casts them (``model.to(dtype)``) before ``build_stages``, since the
                       stages bind the model's own parameters
    bf16-mixed         each stage's forward under ``torch.autocast(device, bfloat16)``:
                       one region per stage and micro-batch (autocast's weight copies are
                       made per region and kept by backward, which is what the plan counts);
                       a recomputed forward runs again under the same autocast; the loss is
                       computed inside it too, as ``with autocast: loss_fn(model(x), y)``
                       would; backward runs outside; parameters, gradients and optimizer
                       state stay float32
    16-mixed           the same with float16, and the loss scaled by a
                       ``torch.amp.GradScaler`` before backward (it works on the CPU too:
                       ``GradScaler("cpu")``); call ``scaler.step(optimizer)`` and
                       ``scaler.update()`` after ``step``

Under torchrun (pipelining.py) the same holds per rank: each ``StageAdapter`` runs its
stage under the autocast; the example run that fixes the dtypes torch's
``PipelineStage`` sends and receives runs under it too, on fake tensors of the rank's
device (``example_device``), so a bfloat16 activation crosses as bfloat16; the loss is
computed under it on the last stage's rank (``autocast_loss``). For ``16-mixed`` every
rank holds a ``distributed_grad_scaler``: the last rank scales the loss, so every rank's
gradients carry the same scale, and the ranks agree on skipping a step (an inf on any
rank) and on the next scale.

The compiler's own list of these names is fxpipe/precision.py; this leaf keeps its own
(it imports nothing of fxpipe).
"""

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn

__all__ = ["PRECISIONS", "as_activations", "autocast", "autocast_loss", "check_precision",
           "distributed_grad_scaler", "example_device", "grad_scaler", "true_dtype",
           "unscaled", "warn_uncast"]

_Loss = TypeVar("_Loss", torch.Tensor, torch.Tensor | None)

# name -> (dtype, mixed)
PRECISIONS: dict[str, tuple[torch.dtype, bool]] = {
    "64-true": (torch.float64, False),
    "32-true": (torch.float32, False),
    "bf16-true": (torch.bfloat16, False),
    "16-true": (torch.float16, False),
    "bf16-mixed": (torch.bfloat16, True),
    "16-mixed": (torch.float16, True),
}


def check_precision(precision: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``; a ValueError naming them otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}"
        )
    return precision


def autocast(precision: str, device: torch.device | None
             ) -> contextlib.AbstractContextManager[object]:
    """The autocast region a stage's forward runs in on ``device`` (None: the CPU):
    ``torch.autocast`` at the mixed dtype, or nothing for a ``*-true`` precision."""
    dtype, mixed = PRECISIONS[precision]
    if not mixed:
        return contextlib.nullcontext()
    return torch.autocast(device.type if device is not None else "cpu", dtype=dtype)


def grad_scaler(precision: str, device: torch.device | None) -> torch.amp.GradScaler | None:
    """A ``GradScaler`` for ``16-mixed`` (float16 gradients underflow without one), else None."""
    if precision != "16-mixed":
        return None
    return torch.amp.GradScaler(device.type if device is not None else "cpu")


def as_activations(precision: str, inputs: dict[str, Any],
                   received: Callable[[str], bool]) -> dict[str, Any]:
    """A stage's ``inputs`` by name, each ``received`` float32 leaf that requires grad
    read through a view of it under a mixed precision.

    Autocast caches its cast of a float32 leaf that requires grad for the rest of the
    region (it takes one for a parameter): two ops of the stage reading one received
    value would share one bfloat16 copy, and backward would sum their gradients in
    bfloat16 before casting up once. In the model that value is an activation, cast
    once per op, its gradients summed in float32. A view is no leaf to autocast, and
    its gradient reaches the leaf unchanged."""
    if not PRECISIONS[precision][1]:
        return inputs
    return {name: value.view_as(value) if (
        received(name) and isinstance(value, torch.Tensor) and value.is_leaf
        and value.requires_grad and value.dtype == torch.float32) else value
        for name, value in inputs.items()}


def distributed_grad_scaler(precision: str, device: torch.device, group: Any = None
                            ) -> torch.amp.GradScaler | None:
    """``grad_scaler`` for a rank of a torchrun pipeline: FSDP's ``ShardedGradScaler``,
    which all-reduces the inf check over ``group`` (default: the whole job) in
    ``unscale_``, so every rank steps or skips together and keeps the same scale (the
    last stage's rank scaled the loss every rank's gradients come from). Collective:
    every rank calls ``scaler.step(optimizer)`` and ``scaler.update()`` each step."""
    if precision != "16-mixed":
        return None
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device.type, process_group=group or dist.group.WORLD)
    # the scale is made by the first scale() call, which only the last stage's rank makes:
    # make it on every rank, or step() on the others finds none
    scaler.scale(torch.zeros((), device=device))
    return scaler


def autocast_loss(loss_fn: Callable[[Any, Any], torch.Tensor] | None, precision: str,
                  device: torch.device | None, scaler: torch.amp.GradScaler | None = None,
                  ) -> tuple[Callable[[Any, Any], torch.Tensor] | None,
                             torch.amp.GradScaler | None]:
    """``loss_fn`` computed under the plan's autocast, as the single-process runner
    computes it (``loss_fn`` itself for a ``*-true`` precision), and the rank's
    ``scaler`` for 16-mixed (``distributed_grad_scaler`` on ``device`` unless given),
    which scales the loss for the backward torch's schedules run from it."""
    if scaler is None and device is not None:
        scaler = distributed_grad_scaler(precision, device)
    if loss_fn is None or not PRECISIONS[precision][1]:
        return loss_fn, scaler

    def mixed_loss(output: Any, target: Any) -> torch.Tensor:
        with autocast(precision, device):
            loss = loss_fn(output, target)
        return loss if scaler is None else scaler.scale(loss)

    return mixed_loss, scaler


def unscaled(loss: _Loss, scaler: torch.amp.GradScaler | None) -> _Loss:
    """A loss reported to the caller: divided by the scale its backward ran at (a power
    of two: exact), as the single-process runner reports the unscaled loss."""
    if loss is None or scaler is None:
        return loss
    return cast(_Loss, loss / scaler.get_scale())


def example_device(precision: str, device: torch.device | None) -> torch.device:
    """Where the fake example run that fixes a stage's send and receive metadata puts
    its tensors: on the CPU for a ``*-true`` precision (the dtypes do not depend on the
    device), on ``device`` for a mixed one, because autocast casts by the tensors'
    device type and its lists of ops differ between the CPU and CUDA."""
    if not PRECISIONS[precision][1] or device is None:
        return torch.device("cpu")
    return device


def true_dtype(precision: str) -> torch.dtype | None:
    """The dtype a ``*-true`` precision casts the model and inputs to; None when mixed."""
    dtype, mixed = PRECISIONS[precision]
    return None if mixed else dtype


def warn_uncast(stages: Sequence[nn.Module], precision: str) -> None:
    """Warn when a ``bf16-true`` or ``16-true`` plan's stages hold floating-point
    parameters of another dtype: the plan counted bytes and FLOP/s at its dtype, the run
    would not match it. (``32-true`` and ``64-true`` train the model as it is.)"""
    dtype = true_dtype(precision)
    if dtype is None or dtype.itemsize >= 4:
        return
    for k, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            if param.is_floating_point() and param.dtype != dtype:
                warnings.warn(
                    f"The plan trains {precision} but stage {k}'s parameter {name!r} is "
                    f"{param.dtype}: cast the model with model.to({dtype}) (and the inputs) "
                    f"before build_stages.",
                    stacklevel=3,
                )
                return
