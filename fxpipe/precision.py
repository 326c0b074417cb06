"""Training precision, by the names Lightning gives it.

    64-true     everything float64
    32-true     everything float32
    bf16-true   everything bfloat16: parameters, gradients, optimizer state, activations
    16-true     everything float16
    bf16-mixed  torch.autocast(dtype=torch.bfloat16): float32 parameters, gradients and
                optimizer state; matmuls, activations and sent tensors in bfloat16, plus
                the bfloat16 weight copies autocast makes and backward keeps
    16-mixed    the same with float16 (and a GradScaler, which costs no memory to speak of)

A plan is made for one precision: the analysis passes run the graph as that precision
runs it (``fxpipe.kernels.Execution``), so bytes, FLOP/s and sent tensors follow.

The generated runner trains the way the plan assumes (``plan.json``'s ``precision``,
written into runner.py as ``PRECISION`` and applied by fxpipe/runtime/mixed_precision.py):
for ``*-mixed``, each stage's forward under ``torch.autocast(device_type, dtype)`` (one
autocast region per stage forward and micro-batch: autocast's weight copies are made per
region and kept by backward, which is what the plan counts), backward outside it, float32
parameters and optimizer, and a ``torch.amp.GradScaler`` for ``16-mixed``; for ``*-true``,
the model and inputs cast to the dtype before the stages are built (by the user for
``bf16-true`` and ``16-true``, which the runner checks; ``32-true`` and ``64-true`` train
the model as it is, so a plan at either is made at the model's own dtype:
``trained_precision``). Sent activations then
have the autocast dtype, so receive buffers must be allocated from the plan's shapes.
The single-process runner does all of this, and so does ``train_torchrun.py``: each
rank's stages run under the autocast, and their send and receive buffers are sized from
an example run under it.
"""

from __future__ import annotations

from enum import Enum

import torch

__all__ = ["Precision", "default_precision", "parse_precision", "precision_note",
           "trained_precision"]


class Precision(str, Enum):
    TRUE_64 = "64-true"
    TRUE_32 = "32-true"
    BF16_MIXED = "bf16-mixed"
    BF16_TRUE = "bf16-true"
    MIXED_16 = "16-mixed"
    TRUE_16 = "16-true"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype matmuls run in and activations are kept in."""
        return _DTYPES[self]

    @property
    def mixed(self) -> bool:
        """True when parameters stay float32 and autocast picks each op's dtype."""
        return self.value.endswith("-mixed")


_DTYPES = {
    Precision.TRUE_64: torch.float64,
    Precision.TRUE_32: torch.float32,
    Precision.BF16_MIXED: torch.bfloat16,
    Precision.BF16_TRUE: torch.bfloat16,
    Precision.MIXED_16: torch.float16,
    Precision.TRUE_16: torch.float16,
}


def parse_precision(name: str) -> Precision:
    """The ``Precision`` called ``name``; a ValueError naming the valid ones otherwise."""
    try:
        return Precision(name.strip().lower())
    except ValueError:
        valid = ", ".join(p.value for p in Precision)
        raise ValueError(f"unknown precision {name!r}; use one of {valid}") from None


def default_precision(module: torch.nn.Module) -> Precision:
    """The precision a model trains in when none is asked for: its parameters' dtype
    (the first floating one), ``32-true`` for float32 or a model without parameters."""
    for tensor in module.parameters():
        if tensor.is_floating_point():
            for precision in (Precision.TRUE_64, Precision.BF16_TRUE, Precision.TRUE_16):
                if tensor.dtype == precision.dtype:
                    return precision
            return Precision.TRUE_32
    return Precision.TRUE_32


# Precisions the runtime trains the model at as it is, casting nothing (and checking no
# dtype): a plan at one of them is made at the model's own dtype, which is what runs.
_AS_IT_IS = (Precision.TRUE_64, Precision.TRUE_32)


def trained_precision(asked: Precision | None, module: torch.nn.Module) -> Precision:
    """The precision a run of ``module`` planned at ``asked`` trains in, which the plan
    must cost: ``asked``, but for ``64-true`` and ``32-true``, under which the runtime
    trains the model as it is, the model's own (``default_precision``): a float64 model
    planned at 32-true trains in float64, twice the bytes float32 would count. None: the
    model's own."""
    if asked is None or asked in _AS_IT_IS:
        return default_precision(module)
    return asked


def precision_note(asked: Precision | None, module: torch.nn.Module) -> str | None:
    """The note saying that a plan at ``asked`` is made at the model's own precision
    instead (``trained_precision``), and how to train at ``asked``; None where it is not."""
    trained = trained_precision(asked, module)
    if asked is None or trained is asked:
        return None
    dtype = str(asked.dtype).removeprefix("torch.")
    return (f"precision {asked.value} trains the model as it is, and its parameters are "
            f"{str(trained.dtype).removeprefix('torch.')}: planned at {trained.value}, as "
            f"the run will train it; to train in {dtype}, return the model cast "
            f"(model.to(torch.{dtype})) from build_model()")
