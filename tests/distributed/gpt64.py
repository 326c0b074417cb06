"""examples/gpt.py's small GPT in float64 (its token ids and targets as they are): a model
file for the torchrun tests that check gradients to 1e-12."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from torch import nn

_spec = importlib.util.spec_from_file_location(
    "_gpt_example", Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
assert _spec is not None and _spec.loader is not None
_gpt: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)

example_inputs = _gpt.example_inputs
example_target = _gpt.example_target
loss_fn = _gpt.loss_fn


def build_model() -> nn.Module:
    return _gpt.build_model().double()
