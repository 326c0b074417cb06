"""examples/hf_gpt2.py's Hugging Face GPT-2 in float64 (its LM head tied to the token
embedding; torch.export writes its Conv1D layers as ``addmm`` on (in, out) weights): a
model file for the torchrun tests that check gradients to 1e-12."""

from __future__ import annotations

try:
    from tests.distributed.llama64 import in_float64
except ModuleNotFoundError:  # loaded by path, as train_torchrun loads a model file
    from llama64 import in_float64  # type: ignore[no-redef]

build_model, example_inputs, example_target, loss_fn = in_float64("hf_gpt2")
