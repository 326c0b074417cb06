"""examples/hf_llama.py's Hugging Face Llama (grouped-query attention: 4 heads, 2 KV heads)
in float64, its RMSNorms computed in float64: a model file for the torchrun tests that
check gradients to 1e-12. (Hugging Face's RMSNorm computes in float32 whatever the model's
dtype; where tensor parallelism sums a value in another order, its last float64 bit can
round to another float32, 1e-7 of it.)"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn


def example_file(name: str) -> Any:
    """examples/{name}.py, imported by path."""
    spec = importlib.util.spec_from_file_location(
        f"_{name}_example", Path(__file__).resolve().parents[2] / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_float64(name: str) -> tuple[Any, Any, Any, Any]:
    """examples/{name}.py's model file in float64: (build_model, example_inputs,
    example_target, loss_fn), its token ids and targets as they are."""
    example = example_file(name)

    def build_model() -> nn.Module:
        return example.build_model().double()

    return build_model, example.example_inputs, example.example_target, example.loss_fn


_llama = example_file("hf_llama")

example_inputs = _llama.example_inputs
example_target = _llama.example_target
loss_fn = _llama.loss_fn


def _rms_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                          + self.variance_epsilon))


def build_model() -> nn.Module:
    model = _llama.build_model().double()
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = types.MethodType(_rms_norm, module)
    return model
