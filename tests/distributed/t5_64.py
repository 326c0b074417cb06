"""examples/hf_t5.py's Hugging Face T5 (an encoder-decoder: 2 + 2 layers, its embedding
shared by the encoder, the decoder and the LM head) in float64: a model file for the
torchrun tests that check gradients to 1e-12."""

from __future__ import annotations

from torch import nn

from tests.distributed.llama64 import example_file

_t5 = example_file("hf_t5")

example_inputs = _t5.example_inputs
example_target = _t5.example_target
loss_fn = _t5.loss_fn


def build_model() -> nn.Module:
    return _t5.build_model().double()
