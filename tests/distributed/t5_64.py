"""examples/hf_t5.py's Hugging Face T5 (an encoder-decoder: 2 + 2 layers, its embedding
shared by the encoder, the decoder and the LM head) in float64: a model file for the
torchrun tests that check gradients to 1e-12."""

from __future__ import annotations

try:
    from tests.distributed.llama64 import in_float64
except ModuleNotFoundError:  # loaded by path, as train_torchrun loads a model file
    from llama64 import in_float64  # type: ignore[no-redef]

build_model, example_inputs, example_target, loss_fn = in_float64("hf_t5")
