"""examples/hf_gpt2.py's Hugging Face GPT-2 in float64 (its LM head tied to the token
embedding; torch.export writes its Conv1D layers as ``addmm`` on (in, out) weights): a
model file for the torchrun tests that check gradients to 1e-12."""

from __future__ import annotations

from torch import nn

from tests.distributed.llama64 import example_file

_gpt2 = example_file("hf_gpt2")

example_inputs = _gpt2.example_inputs
example_target = _gpt2.example_target
loss_fn = _gpt2.loss_fn


def build_model() -> nn.Module:
    return _gpt2.build_model().double()
