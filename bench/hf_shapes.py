"""Hugging Face transformers models at real sizes, built on the meta device (no storage),
for timing ``fxpipe split`` at scale (bench/split_speed.py).

Each factory follows the model-file contract and carries its own micro-batch:

    fxpipe split bench/hf_shapes.py:build_llama3_70b --gpus 32
    fxpipe split bench/hf_shapes.py:build_gpt2_xl --gpus 8
    fxpipe split bench/hf_shapes.py:build_llama3_8b --gpus 8
    fxpipe split bench/hf_shapes.py:build_llama3_405b --gpus 128 --precision bf16-mixed
    fxpipe split bench/hf_shapes.py:build_gpt_oss_20b --gpus 8 --precision bf16-mixed
    fxpipe split bench/hf_shapes.py:build_gemma2_9b --gpus 8 --precision bf16-mixed --memory 40GiB
    fxpipe split bench/hf_shapes.py:build_gemma2_small --gpus 4   (random weights, CPU)

Token ids are drawn below 1000, inside every vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _ids(batch: int, seq: int, shift: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (batch, seq + 1), generator=g)
    return ids[:, shift : shift + seq]


def _factory(make: Callable[[], nn.Module], batch: int, seq: int, name: str
             ) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return make()

    build.__name__ = build.__qualname__ = name
    build.example_inputs = lambda: {"input_ids": _ids(batch, seq, 0)}  # type: ignore[attr-defined]
    build.example_target = lambda: _ids(batch, seq, 1)  # type: ignore[attr-defined]
    return build


def _on(device: str | None, make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    if device is None:
        return make().train()
    with torch.device(device):
        return make().train()


def _llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=8192,
                      attention_dropout=0.0, use_cache=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _gpt2_xl() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                     use_cache=False)
    return GPT2LMHeadModel(cfg)


def _gemma2_small() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=1000, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=128, attention_dropout=0.0,
                       use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Gemma2ForCausalLM(cfg)


def _gemma2_9b() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, max_position_embeddings=4096, use_cache=False)
    return Gemma2ForCausalLM(cfg)


def _gpt_oss_20b() -> nn.Module:
    """GPT-OSS-20B's shape: 24 layers alternating sliding-window and full attention with
    sinks (transformers runs it eagerly), 32 experts, 4 per token."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                       num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                       sliding_window=128, max_position_embeddings=8192,
                       attention_dropout=0.0, use_cache=False)
    return GptOssForCausalLM(cfg)


build_llama3_70b = _factory(
    lambda: _on("meta", lambda: _llama(80, 8192, 64, 8, 28672, 128256)), 1, 4096,
    "build_llama3_70b")
build_llama3_70b_8k = _factory(
    lambda: _on("meta", lambda: _llama(80, 8192, 64, 8, 28672, 128256)), 1, 8192,
    "build_llama3_70b_8k")
build_llama3_8b = _factory(
    lambda: _on("meta", lambda: _llama(32, 4096, 32, 8, 14336, 128256)), 1, 4096,
    "build_llama3_8b")
# Llama-3-405B: 126 layers, width 16384, 128 heads / 8 KV heads, feed-forward 53248
build_llama3_405b = _factory(
    lambda: _on("meta", lambda: _llama(126, 16384, 128, 8, 53248, 128256)), 1, 8192,
    "build_llama3_405b")
build_gpt2_xl = _factory(lambda: _on("meta", _gpt2_xl), 1, 1024, "build_gpt2_xl")
build_gpt_oss_20b = _factory(lambda: _on("meta", _gpt_oss_20b), 1, 4096, "build_gpt_oss_20b")
build_gemma2_9b = _factory(lambda: _on("meta", _gemma2_9b), 1, 4096, "build_gemma2_9b")
build_gemma2_small = _factory(lambda: _on(None, _gemma2_small), 2, 32, "build_gemma2_small")
build_model = build_gemma2_small


def example_inputs() -> dict[str, torch.Tensor]:
    return build_gemma2_small.example_inputs()  # type: ignore[attr-defined,no-any-return]


def example_target() -> torch.Tensor:
    return build_gemma2_small.example_target()  # type: ignore[attr-defined,no-any-return]


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", output)
    if isinstance(logits, tuple | list):
        logits = logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


# a Llama small enough to train on one GPU, large enough that memory and time are real:
# 16 x 2048, 16 heads / 8 KV heads, FFN 5632, vocab 32000 (886M parameters), 4096 tokens
LLAMA_SCALED = {"layers": 16, "hidden": 2048, "heads": 16, "kv": 8, "ffn": 5632, "vocab": 32000}


def llama_scaled(device: str | None) -> nn.Module:
    """The scaled Llama with seed-0 weights on ``device`` (None: the CPU)."""
    return _on(device, lambda: _llama(**LLAMA_SCALED))


build_llama_scaled = _factory(lambda: llama_scaled("meta"), 1, 4096, "build_llama_scaled")
