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

The compiler's own list of these names is fxpipe/precision.py; this leaf keeps its own
(it imports nothing of fxpipe).
"""

import contextlib
import warnings
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["PRECISIONS", "autocast", "check_precision", "grad_scaler", "true_dtype",
           "warn_torchrun_mixed", "warn_uncast"]

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
            f"Unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}."
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


def warn_torchrun_mixed(precision: str) -> None:
    """Warn, from ``build_schedule``, that a mixed-precision plan trains in float32 under
    torchrun: torch's stages check each sent tensor's dtype against the example run's
    (float32), while autocast makes some of them bfloat16 (not solved yet)."""
    if PRECISIONS[precision][1]:
        warnings.warn(
            f"The plan trains {precision}, but the torchrun pipeline runs without "
            f"autocast (float32 activations, no GradScaler); runner.PipelineRunner "
            f"trains {precision} in one process.",
            stacklevel=3,
        )
