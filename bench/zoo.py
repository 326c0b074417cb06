"""A zoo of models nobody here wrote, split by fxpipe and checked for transparency.

    python bench/zoo.py                 # transformers families (small random configs)
    python bench/zoo.py --vision        # torchvision and timm models (needs both installed)
    python bench/zoo.py --only gpt2,t5  # a few models, by slug
    python bench/zoo.py --gpus 4        # every family onto 4 stages (default: its own, 2-4)
    python bench/zoo.py --schedule zb1p # another schedule (default 1f1b; interleaved takes
                                        # --virtual-stages, and M = 4 micro-batches a
                                        # multiple of the GPUs: --gpus 2 or 4)
    python bench/zoo.py --layers 7      # 7 layers per stack instead of 2: stacks of six or
                                        # more identical layers are exported two deep
                                        # (three where the first runs unlike the others)
                                        # and copied (capture "export, copied 2 deep")
    python bench/zoo.py --recompute all # every stage runs its forward again in backward
    python bench/zoo.py --recompute selective  # all of it but its matmuls and attention
    python bench/zoo.py --recompute selective --keep-level 0  # keeping only the outputs
                                        # of the model's leanest keep level
    python bench/zoo.py --padded        # the token models given a padding mask, half the
                                        # samples padded on the left
    python bench/zoo.py --precision bf16-mixed  # float32 models planned, traced and
                                        # trained under CPU autocast, against the model
                                        # under autocast micro-batch by micro-batch

For every model the benchmark writes a model file the way a user would (``build_model``,
``example_inputs``, ``example_target``, ``loss_fn``; random weights from a config,
float64 unless said, nothing downloaded), runs the sequence ``fxpipe split`` runs on it
(load, trace, analyse, plan onto 2-4 stages with 1F1B and M=4, write the output folder,
import the generated package), and trains one mini-batch of M micro-batches through the
generated ``PipelineRunner``:

- forward: ``runner.forward(**batch)`` against the model on the whole mini-batch;
- loss and gradients: ``runner.step(batch, target, loss_fn)`` against the model's own
  loss and ``backward`` (another copy of the model, built by the same file): every
  parameter's gradient and every buffer (BatchNorm's statistics and counters).

"pass (per micro-batch)": the model itself computes something else on the whole
mini-batch than micro-batch by micro-batch (BatchNorm in training mode normalizes by
the batch; a float64 model that computes in float32 inside sums in another order), so
the pipeline is compared with the model run micro-batch by micro-batch, gradients
accumulated; the notes under the table say which. Tolerances: 1e-9 relative in float64,
1e-5 in float32 (outputs and loss relative to their largest magnitude; a gradient to its
own, or to 1e-6 of the model's largest gradient where it is zero up to rounding, as an
attention key bias is); 2e-2 under a ``*-mixed`` precision, whose bfloat16 rounds a
sum taken in another order (a tensor laid out otherwise) by a last bit, with bfloat16's
epsilon (2^-8) of the largest gradient as the floor. "ruff": the
generated package under the project's rules.
A row that fails gives the phase and the one-line reason; nothing stops the table.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxpipe.codegen import load_package
from fxpipe.codegen.stages import LINE_LENGTH
from fxpipe.compiler import SplitOptions, _lowered, analyze_file, output_files, plan_split
from fxpipe.cost_models import get_device
from fxpipe.output import write_folder
from fxpipe.partition import Recompute
from fxpipe.passes.base import OP_NODES
from fxpipe.plan import Plan, StageRecompute
from fxpipe.precision import Precision, parse_precision
from fxpipe.runtime.loading import import_file
from fxpipe.schedules import ScheduleKind

MICRO = 2  # samples per micro-batch
MICROBATCHES = 4

# --- the model files ---------------------------------------------------------

MODEL_FILE = '''"""{name} ({kind}): a small random {builder}, {dtype}, written by bench/zoo.py."""

import torch
import torch.nn.functional as F
{imports}

MICRO = {micro}  # samples per micro-batch


def build_model():
    torch.manual_seed(0)
    model = {build}
{setup}    return model.to(torch.{dtype}).train()


def make_batch(size, seed):
    """``size`` samples: the model's keyword inputs and the loss target."""
    g = torch.Generator().manual_seed(seed)
{batch}


def example_inputs():
    return make_batch(MICRO, 0)[0]


def example_target():
    return make_batch(MICRO, 0)[1]


def loss_fn(output, target):
    logits = output if isinstance(output, torch.Tensor) else output["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
'''

# The body of make_batch for each kind of input (fields filled from Family.inputs).
BATCHES = {
    # next-token prediction (decoders) or a token to predict at every position (encoders)
    "tokens": """\
    ids = torch.randint(3, {vocab}, (size, {seq} + 1), generator=g)
    return {{"input_ids": ids[:, :-1]}}, ids[:, 1:]""",
    # the same with a padding mask (--padded): the later half of the samples padded on the
    # left, as a batch of prompts of different lengths is, each its own mask
    "tokens_padded": """\
    ids = torch.randint(3, {vocab}, (size, {seq} + 1), generator=g)
    mask = torch.ones(size, {seq}, dtype=torch.long)
    mask[size // 2:, :{seq} // 4] = 0
    return {{"input_ids": ids[:, :-1], "attention_mask": mask}}, ids[:, 1:]""",
    # teacher forcing: the decoder reads the labels shifted right behind a start token
    "seq2seq": """\
    ids = torch.randint(3, {vocab}, (size, {seq}), generator=g)
    labels = torch.randint(3, {vocab}, (size, {seq} // 2), generator=g)
    start = torch.full((size, 1), {start})
    decoder_ids = torch.cat([start, labels[:, :-1]], dim=1)
    return {{"input_ids": ids, "decoder_input_ids": decoder_ids}}, labels""",
    # the same with an attention mask (every token kept) for a model that needs one
    "seq2seq_masked": """\
    ids = torch.randint(3, {vocab}, (size, {seq}), generator=g)
    labels = torch.randint(3, {vocab}, (size, {seq} // 2), generator=g)
    start = torch.full((size, 1), {start})
    decoder_ids = torch.cat([start, labels[:, :-1]], dim=1)
    inputs = {{"input_ids": ids, "attention_mask": torch.ones(size, {seq}, dtype=torch.long),
              "decoder_input_ids": decoder_ids}}
    return inputs, labels""",
    "speech2text": """\
    features = torch.randn(size, {mels}, {frames}, generator=g, dtype=torch.{dtype})
    labels = torch.randint(3, {vocab}, (size, {seq}), generator=g)
    start = torch.full((size, 1), {start})
    decoder_ids = torch.cat([start, labels[:, :-1]], dim=1)
    return {{"input_features": features, "decoder_input_ids": decoder_ids}}, labels""",
    "waveform": """\
    wave = torch.randn(size, {samples}, generator=g, dtype=torch.{dtype})
    return {{"input_values": wave}}, torch.randint(0, {classes}, (size,), generator=g)""",
    "image": """\
    pixels = torch.randn(size, 3, {size}, {size}, generator=g, dtype=torch.{dtype})
    return {{"{key}": pixels}}, torch.randint(0, {classes}, (size,), generator=g)""",
}


@dataclass(frozen=True)
class Family:
    slug: str
    name: str
    kind: str  # decoder, encoder, enc-dec, vision, audio, MoE, SSM
    build: str  # an expression building the model (float32; the file makes it float64)
    inputs: tuple[str, dict[str, Any]]  # a BATCHES key and its fields
    stages: int = 3
    imports: str = "import transformers"
    dtype: str = "float64"
    setup: str = ""  # statements after the model is built (indented by 4)

    def source(self) -> str:
        kind, fields = self.inputs
        return MODEL_FILE.format(
            name=self.name, kind=self.kind, builder=self.build.split("(")[0],
            imports=self.imports, micro=MICRO, build=self.build, dtype=self.dtype,
            setup=self.setup,
            batch=BATCHES[kind].format(dtype=self.dtype, **fields),
        )


def _tokens(vocab: int = 100, seq: int = 8) -> tuple[str, dict[str, Any]]:
    return ("tokens", {"vocab": vocab, "seq": seq})


def _hf(model: str, config: str, **kwargs: Any) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"transformers.{model}(transformers.{config}({args}))"


# Sizes shared by the decoders: width 32, 2 layers, 4 heads (2 KV heads), vocab 100.
_DECODER = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_ENCODER = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, pad_token_id=0)
_BART = dict(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
             decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
             use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             decoder_start_token_id=2, forced_eos_token_id=2)

# Sizes shared by the speech encoders (a waveform through a small convolution stack).
_AUDIO = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64, conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
              num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
              activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
              final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
              classifier_proj_size=16, num_labels=10)

TRANSFORMERS = [
    Family("gpt2", "GPT-2", "decoder",
           _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=100, n_positions=64, n_embd=32,
               n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
           _tokens(), stages=2),
    Family("llama", "Llama", "decoder",
           _hf("LlamaForCausalLM", "LlamaConfig", **_DECODER, attention_dropout=0.0),
           _tokens(), stages=3),
    Family("mistral", "Mistral", "decoder",
           _hf("MistralForCausalLM", "MistralConfig", **_DECODER, attention_dropout=0.0,
               sliding_window=4),
           _tokens(), stages=4),
    Family("qwen2", "Qwen2", "decoder",
           _hf("Qwen2ForCausalLM", "Qwen2Config", **_DECODER, attention_dropout=0.0),
           _tokens(), stages=2),
    Family("gemma2", "Gemma2", "decoder",
           _hf("Gemma2ForCausalLM", "Gemma2Config", **_DECODER, head_dim=8,
               attention_dropout=0.0, sliding_window=4),
           _tokens(), stages=3),
    Family("falcon", "Falcon", "decoder",
           _hf("FalconForCausalLM", "FalconConfig", vocab_size=100, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
               multi_query=True, alibi=False, hidden_dropout=0.0, attention_dropout=0.0,
               use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
           _tokens(), stages=3),
    Family("opt", "OPT", "decoder",
           _hf("OPTForCausalLM", "OPTConfig", vocab_size=100, hidden_size=32, ffn_dim=64,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
               word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, layerdrop=0.0, use_cache=False, bos_token_id=1,
               eos_token_id=2, pad_token_id=0),
           _tokens(), stages=4),
    Family("phi3", "Phi-3", "decoder",
           _hf("Phi3ForCausalLM", "Phi3Config", **_DECODER, attention_dropout=0.0,
               resid_pdrop=0.0, embd_pdrop=0.0),
           _tokens(), stages=2),
    # MoE experts: transformers' default, grouped_mm, has no float64 kernel on the CPU, so
    # the float64 rows take batched_mm; "eager" loops over the experts the tokens chose,
    # data-dependent control flow that neither tracer captures (fxpipe says so).
    Family("mixtral", "Mixtral", "MoE",
           _hf("MixtralForCausalLM", "MixtralConfig", **_DECODER, attention_dropout=0.0,
               num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
               experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("mixtral_grouped", "Mixtral (grouped_mm, float32)", "MoE",
           _hf("MixtralForCausalLM", "MixtralConfig", **_DECODER, attention_dropout=0.0,
               num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0),
           _tokens(), stages=2, dtype="float32"),
    Family("qwen2_moe", "Qwen2-MoE", "MoE",
           _hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_DECODER, attention_dropout=0.0,
               moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
               num_experts_per_tok=2, decoder_sparse_step=1,
               experts_implementation="batched_mm"),
           _tokens(), stages=4),
    # Added on 2026-11-26: the decoders and MoE models released or popular since the
    # first zoo (each at its transformers 5.x config names).
    Family("qwen3", "Qwen3", "decoder",
           _hf("Qwen3ForCausalLM", "Qwen3Config", **_DECODER, head_dim=8,
               attention_dropout=0.0),
           _tokens(), stages=3),
    Family("gemma3", "Gemma3", "decoder",
           _hf("Gemma3ForCausalLM", "Gemma3TextConfig", **_DECODER, head_dim=8,
               attention_dropout=0.0, sliding_window=4),
           _tokens(), stages=3),
    Family("gptneox", "GPT-NeoX", "decoder",
           _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, use_cache=False, hidden_dropout=0.0,
               attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
           _tokens(), stages=3),
    Family("olmo2", "OLMo2", "decoder",
           _hf("Olmo2ForCausalLM", "Olmo2Config", **_DECODER, attention_dropout=0.0),
           _tokens(), stages=3),
    Family("cohere", "Cohere", "decoder",
           _hf("CohereForCausalLM", "CohereConfig", **_DECODER, attention_dropout=0.0),
           _tokens(), stages=3),
    Family("granite", "Granite", "decoder",
           _hf("GraniteForCausalLM", "GraniteConfig", **_DECODER, attention_dropout=0.0),
           _tokens(), stages=3),
    Family("stablelm", "StableLM", "decoder",
           _hf("StableLmForCausalLM", "StableLmConfig", **_DECODER, attention_dropout=0.0,
               hidden_dropout=0.0),
           _tokens(), stages=3),
    Family("gptj", "GPT-J", "decoder",
           _hf("GPTJForCausalLM", "GPTJConfig", vocab_size=100, n_positions=64, n_embd=32,
               n_layer=2, n_head=4, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=2,
               pad_token_id=0),
           _tokens(), stages=2),
    Family("bloom", "Bloom", "decoder",
           _hf("BloomForCausalLM", "BloomConfig", vocab_size=100, hidden_size=32, n_layer=2,
               n_head=4, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=0),
           _tokens(), stages=3),
    Family("phi", "Phi-2", "decoder",
           _hf("PhiForCausalLM", "PhiConfig", vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0,
               attention_dropout=0.0, use_cache=False, bos_token_id=1, eos_token_id=2,
               pad_token_id=0),
           _tokens(), stages=3),
    Family("starcoder2", "Starcoder2", "decoder",
           _hf("Starcoder2ForCausalLM", "Starcoder2Config", **_DECODER, attention_dropout=0.0,
               residual_dropout=0.0, embedding_dropout=0.0),
           _tokens(), stages=3),
    Family("qwen3_moe", "Qwen3-MoE", "MoE",
           _hf("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **_DECODER, head_dim=8,
               attention_dropout=0.0, moe_intermediate_size=32, num_experts=4,
               num_experts_per_tok=2, decoder_sparse_step=1,
               experts_implementation="batched_mm"),
           _tokens(), stages=3),
    # Layer 0 dense, the others MoE (first_k_dense_replace), with multi-head latent
    # attention (q and kv through low-rank projections).
    Family("deepseek_v3", "DeepSeek-V3", "MoE",
           _hf("DeepseekV3ForCausalLM", "DeepseekV3Config", vocab_size=100, hidden_size=32,
               intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
               first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
               n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
               q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
               v_head_dim=8, max_position_embeddings=64, use_cache=False,
               attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("mamba", "Mamba", "SSM",
           _hf("MambaForCausalLM", "MambaConfig", vocab_size=100, hidden_size=32, state_size=8,
               num_hidden_layers=2, expand=2, conv_kernel=4, use_cache=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=0),
           _tokens(), stages=2),
    Family("t5", "T5", "enc-dec",
           _hf("T5ForConditionalGeneration", "T5Config", vocab_size=100, d_model=32, d_kv=8,
               d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
               use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
           ("seq2seq", {"vocab": 100, "seq": 8, "start": 0}), stages=3),
    Family("bart", "BART", "enc-dec",
           _hf("BartForConditionalGeneration", "BartConfig", **_BART),
           ("seq2seq", {"vocab": 100, "seq": 8, "start": 2}), stages=4),
    Family("bert", "BERT", "encoder",
           _hf("BertForMaskedLM", "BertConfig", **_ENCODER), _tokens(), stages=2),
    Family("roberta", "RoBERTa", "encoder",
           _hf("RobertaForMaskedLM", "RobertaConfig", **_ENCODER), _tokens(), stages=3),
    Family("distilbert", "DistilBERT", "encoder",
           _hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=100, dim=32, n_layers=2,
               n_heads=4, hidden_dim=64, max_position_embeddings=64, dropout=0.0,
               attention_dropout=0.0, pad_token_id=0),
           _tokens(), stages=2),
    Family("vit", "ViT", "vision",
           _hf("ViTForImageClassification", "ViTConfig", image_size=32, patch_size=8,
               hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, num_labels=10),
           ("image", {"size": 32, "key": "pixel_values", "classes": 10}), stages=3),
    Family("convnext", "ConvNeXt", "vision",
           _hf("ConvNextForImageClassification", "ConvNextConfig", num_channels=3,
               hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 2, 1], drop_path_rate=0.0,
               num_labels=10),
           ("image", {"size": 32, "key": "pixel_values", "classes": 10}), stages=4),
    Family("whisper", "Whisper", "audio",
           _hf("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=100,
               num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=32,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
               decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32,
               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
               encoder_layerdrop=0.0, decoder_layerdrop=0.0, use_cache=False,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
               suppress_tokens=None, begin_suppress_tokens=None),
           ("speech2text", {"mels": 16, "frames": 32, "vocab": 100, "seq": 8, "start": 3}),
           stages=3),
    Family("wav2vec2", "Wav2Vec2", "audio",
           _hf("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", **_AUDIO),
           ("waveform", {"samples": 400, "classes": 10}), stages=2),
    # Added on 2026-11-27: more decoders, MoE and hybrid models of transformers 5.x, and
    # encoders with their own attention (disentangled, local and global).
    Family("gpt_oss", "GPT-OSS", "MoE",
           _hf("GptOssForCausalLM", "GptOssConfig", **_DECODER, attention_dropout=0.0,
               head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
               experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("granitemoe", "GraniteMoE", "MoE",
           _hf("GraniteMoeForCausalLM", "GraniteMoeConfig", **_DECODER, num_local_experts=4,
               num_experts_per_tok=2, experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("olmoe", "OLMoE", "MoE",
           _hf("OlmoeForCausalLM", "OlmoeConfig", **_DECODER, num_experts=4,
               num_experts_per_tok=2, experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("llama4", "Llama-4 (text)", "MoE",
           _hf("Llama4ForCausalLM", "Llama4TextConfig", **_DECODER, head_dim=8,
               intermediate_size_mlp=64, num_local_experts=4, interleave_moe_layer_step=1),
           _tokens(), stages=3),
    Family("glm4", "GLM-4", "decoder",
           _hf("Glm4ForCausalLM", "Glm4Config", **_DECODER, head_dim=8), _tokens(), stages=3),
    Family("smollm3", "SmolLM3", "decoder",
           _hf("SmolLM3ForCausalLM", "SmolLM3Config", **_DECODER), _tokens(), stages=3),
    Family("nemotron", "Nemotron", "decoder",
           _hf("NemotronForCausalLM", "NemotronConfig", **_DECODER), _tokens(), stages=3),
    Family("exaone4", "EXAONE-4", "decoder",
           _hf("Exaone4ForCausalLM", "Exaone4Config", **_DECODER), _tokens(), stages=3),
    Family("mpt", "MPT", "decoder",
           _hf("MptForCausalLM", "MptConfig", vocab_size=100, d_model=32, n_heads=4, n_layers=2,
               expansion_ratio=2, max_seq_len=64, use_cache=False),
           _tokens(), stages=3),
    Family("lfm2", "LFM2 (convolutions and attention)", "hybrid",
           _hf("Lfm2ForCausalLM", "Lfm2Config", **_DECODER, full_attn_idxs=[1]),
           _tokens(), stages=3),
    Family("mamba2", "Mamba2", "SSM",
           _hf("Mamba2ForCausalLM", "Mamba2Config", vocab_size=100, hidden_size=32,
               num_hidden_layers=2, num_heads=8, head_dim=8, state_size=8, n_groups=1,
               chunk_size=4, use_cache=False, pad_token_id=0),
           _tokens(), stages=3),
    Family("modernbert", "ModernBERT", "encoder",
           _hf("ModernBertForMaskedLM", "ModernBertConfig", vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2,
               local_attention=4, attention_dropout=0.0, mlp_dropout=0.0,
               embedding_dropout=0.0),
           _tokens(), stages=3),
    Family("electra", "ELECTRA", "encoder",
           _hf("ElectraForMaskedLM", "ElectraConfig", **_ENCODER, embedding_size=32),
           _tokens(), stages=3),
    Family("deberta_v2", "DeBERTa-v2", "encoder",
           _hf("DebertaV2ForMaskedLM", "DebertaV2Config", **_ENCODER), _tokens(), stages=3),
    Family("albert", "ALBERT (one layer applied in turn)", "encoder",
           _hf("AlbertForMaskedLM", "AlbertConfig", vocab_size=100, embedding_size=16,
               hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, pad_token_id=0),
           _tokens(), stages=2),
    Family("gpt_bigcode", "GPTBigCode (multi-query)", "decoder",
           _hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=100, n_positions=64,
               n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, multi_query=True, use_cache=False),
           _tokens(), stages=2),
    Family("biogpt", "BioGPT", "decoder",
           _hf("BioGptForCausalLM", "BioGptConfig", vocab_size=100, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, layerdrop=0.0, use_cache=False,
               pad_token_id=0),
           _tokens(), stages=2),
    Family("codegen", "CodeGen", "decoder",
           _hf("CodeGenForCausalLM", "CodeGenConfig", vocab_size=100, n_positions=64, n_embd=32,
               n_layer=2, n_head=4, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, use_cache=False),
           _tokens(), stages=2),
    Family("xglm", "XGLM", "decoder",
           _hf("XGLMForCausalLM", "XGLMConfig", vocab_size=100, d_model=32, num_layers=2,
               attention_heads=4, ffn_dim=64, max_position_embeddings=64, dropout=0.0,
               attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, use_cache=False),
           _tokens(), stages=2),
    Family("olmo", "OLMo", "decoder",
           _hf("OlmoForCausalLM", "OlmoConfig", **_DECODER), _tokens(), stages=3),
    Family("arcee", "Arcee", "decoder",
           _hf("ArceeForCausalLM", "ArceeConfig", **_DECODER), _tokens(), stages=3),
    Family("jetmoe", "JetMoE", "MoE",
           _hf("JetMoeForCausalLM", "JetMoeConfig", vocab_size=100, hidden_size=32,
               num_hidden_layers=2, num_key_value_heads=2, kv_channels=8, intermediate_size=64,
               max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
               use_cache=False, bos_token_id=1, eos_token_id=2),
           _tokens(), stages=2),
    Family("falcon_mamba", "FalconMamba", "ssm",
           _hf("FalconMambaForCausalLM", "FalconMambaConfig", vocab_size=100, hidden_size=32,
               state_size=8, num_hidden_layers=2, use_cache=False, pad_token_id=0),
           _tokens(), stages=2),
    Family("xlm_roberta", "XLM-RoBERTa", "encoder",
           _hf("XLMRobertaForMaskedLM", "XLMRobertaConfig", **_ENCODER), _tokens(), stages=2),
    Family("mobilebert", "MobileBERT", "encoder",
           _hf("MobileBertForMaskedLM", "MobileBertConfig", vocab_size=100, hidden_size=32,
               embedding_size=16, intra_bottleneck_size=16, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=32, max_position_embeddings=64,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               num_feedforward_networks=2, pad_token_id=0),
           _tokens(), stages=2),
    # Added on 2026-11-28: more families tried as a new user would, each a small random
    # config at its transformers 5.x names (head_dim set where the default is 128, and
    # dropout off where the config turns it on).
    Family("helium", "Helium", "decoder",
           _hf("HeliumForCausalLM", "HeliumConfig", **_DECODER, attention_dropout=0.0,
               head_dim=8),
           _tokens(), stages=3),
    Family("ernie4_5", "ERNIE-4.5", "decoder",
           _hf("Ernie4_5ForCausalLM", "Ernie4_5Config", **_DECODER), _tokens(), stages=3),
    Family("hunyuan", "HunYuan (dense)", "decoder",
           _hf("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", **_DECODER,
               attention_dropout=0.0, head_dim=8),
           _tokens(), stages=3),
    Family("seed_oss", "Seed-OSS", "decoder",
           _hf("SeedOssForCausalLM", "SeedOssConfig", **_DECODER, attention_dropout=0.0,
               residual_dropout=0.0),
           _tokens(), stages=3),
    Family("persimmon", "Persimmon", "decoder",
           _hf("PersimmonForCausalLM", "PersimmonConfig", vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, use_cache=False, hidden_dropout=0.0,
               attention_dropout=0.0, bos_token_id=1, eos_token_id=2),
           _tokens(), stages=2),
    Family("phimoe", "PhiMoE", "MoE",
           _hf("PhimoeForCausalLM", "PhimoeConfig", **_DECODER, attention_dropout=0.0,
               num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
               input_jitter_noise=0.0, experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("dbrx", "DBRX", "MoE",  # routes by a loop over the experts hit: refused
           _hf("DbrxForCausalLM", "DbrxConfig", vocab_size=100, d_model=32, n_heads=4,
               n_layers=2, max_seq_len=64, use_cache=False,
               attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
               ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
           _tokens(), stages=2),
    Family("deepseek_v2", "DeepSeek-V2", "MoE",
           _hf("DeepseekV2ForCausalLM", "DeepseekV2Config", vocab_size=100, hidden_size=32,
               intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
               first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
               n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
               q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
               v_head_dim=8, max_position_embeddings=64, use_cache=False,
               attention_dropout=0.0, experts_implementation="batched_mm"),
           _tokens(), stages=2),
    Family("bamba", "Bamba (Mamba2 and attention)", "SSM",
           _hf("BambaForCausalLM", "BambaConfig", vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8,
               mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4,
               max_position_embeddings=64, use_cache=False, pad_token_id=0),
           _tokens(), stages=2),
    Family("jamba", "Jamba (Mamba, attention and experts)", "SSM",
           _hf("JambaForCausalLM", "JambaConfig", vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
               expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
               attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
               experts_implementation="batched_mm", use_cache=False, pad_token_id=0),
           _tokens(), stages=2),
    Family("recurrent_gemma", "RecurrentGemma", "SSM",
           _hf("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", vocab_size=100,
               hidden_size=32, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=1, lru_width=32,
               attention_window_size=8, block_types=["recurrent", "attention", "recurrent"],
               use_cache=False, pad_token_id=0),
           _tokens(), stages=2),
    Family("pegasus", "Pegasus", "enc-dec",
           _hf("PegasusForConditionalGeneration", "PegasusConfig", **_BART),
           ("seq2seq", {"vocab": 100, "seq": 8, "start": 2}), stages=3),
    Family("marian", "Marian", "enc-dec",
           _hf("MarianMTModel", "MarianConfig", **_BART),
           ("seq2seq", {"vocab": 100, "seq": 8, "start": 2}), stages=3),
    Family("funnel", "Funnel", "encoder",
           _hf("FunnelForMaskedLM", "FunnelConfig", vocab_size=100, d_model=32, n_head=4,
               d_head=8, d_inner=64, block_sizes=[1, 1], hidden_dropout=0.0,
               attention_dropout=0.0, activation_dropout=0.0),
           _tokens(), stages=2),
    Family("xlnet", "XLNet", "decoder",
           _hf("XLNetLMHeadModel", "XLNetConfig", vocab_size=100, d_model=32, n_layer=2,
               n_head=4, d_inner=64, dropout=0.0, use_mems_train=False),
           _tokens(), stages=2),
    # Added on 2026-11-28 (later): hybrid (linear attention, Mamba2) and MoE decoders of
    # transformers 5.x, and a few encoders, enc-decs, vision and audio models not yet here.
    # Its gated delta rule computes in float32 whatever the model's dtype, and the exported
    # graph rounds it otherwise than eager by 4e-8: compared at float32's tolerance.
    Family("qwen3_next", "Qwen3-Next (gated DeltaNet, attention and experts)", "MoE",
           _hf("Qwen3NextForCausalLM", "Qwen3NextConfig", **_DECODER, head_dim=8,
               attention_dropout=0.0, full_attention_interval=2, linear_conv_kernel_dim=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
               linear_num_value_heads=4, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
               decoder_sparse_step=1, experts_implementation="batched_mm"),
           _tokens(), stages=3, dtype="float32"),
    Family("glm4_moe", "GLM-4-MoE", "MoE",
           _hf("Glm4MoeForCausalLM", "Glm4MoeConfig", **_DECODER, attention_dropout=0.0,
               moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
               num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
               use_qk_norm=True, experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("minimax", "MiniMax (lightning attention and experts)", "MoE",
           _hf("MiniMaxForCausalLM", "MiniMaxConfig", **_DECODER, head_dim=8,
               attention_dropout=0.0, num_local_experts=4, num_experts_per_tok=2,
               router_jitter_noise=0.0, block_size=4, experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("cohere2", "Cohere2", "decoder",
           _hf("Cohere2ForCausalLM", "Cohere2Config", **_DECODER, attention_dropout=0.0,
               sliding_window=4, sliding_window_pattern=2),
           _tokens(), stages=3),
    # clamps a parameter through .data in forward while training: refused
    Family("gemma3n", "Gemma3n (text)", "decoder",
           _hf("Gemma3nForCausalLM", "Gemma3nTextConfig", **_DECODER, head_dim=8,
               attention_dropout=0.0, sliding_window=4, vocab_size_per_layer_input=100,
               hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2,
               num_kv_shared_layers=1),
           _tokens(), stages=3),
    Family("zamba2", "Zamba2 (Mamba2 and a shared attention block)", "SSM",
           _hf("Zamba2ForCausalLM", "Zamba2Config", vocab_size=100, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, layers_block_type=["mamba", "hybrid"], mamba_d_state=8,
               n_mamba_heads=8, mamba_headdim=8, chunk_size=4, max_position_embeddings=64,
               attention_dropout=0.0, use_cache=False, pad_token_id=0),
           _tokens(), stages=2),
    Family("falcon_h1", "Falcon-H1 (attention and Mamba2 in parallel)", "SSM",
           _hf("FalconH1ForCausalLM", "FalconH1Config", **_DECODER, head_dim=8,
               attention_dropout=0.0, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
               mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4),
           _tokens(), stages=2),
    Family("granitemoehybrid", "GraniteMoeHybrid (Mamba2, attention and experts)", "SSM",
           _hf("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", **_DECODER,
               attention_dropout=0.0, num_local_experts=4, num_experts_per_tok=2,
               shared_intermediate_size=32, layer_types=["mamba", "attention"],
               mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4,
               experts_implementation="batched_mm"),
           _tokens(), stages=2),
    Family("dots1", "dots.llm1", "MoE",
           _hf("Dots1ForCausalLM", "Dots1Config", **_DECODER, attention_dropout=0.0,
               moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
               num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
               experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("apertus", "Apertus (xIELU)", "decoder",
           _hf("ApertusForCausalLM", "ApertusConfig", **_DECODER, attention_dropout=0.0),
           _tokens(), stages=3),
    Family("ministral", "Ministral", "decoder",
           _hf("MinistralForCausalLM", "MinistralConfig", **_DECODER, head_dim=8,
               attention_dropout=0.0, sliding_window=4),
           _tokens(), stages=3),
    Family("bitnet", "BitNet (ternary weights)", "decoder",
           _hf("BitNetForCausalLM", "BitNetConfig", **_DECODER, attention_dropout=0.0),
           _tokens(), stages=3),
    Family("glm", "GLM", "decoder",
           _hf("GlmForCausalLM", "GlmConfig", **_DECODER, head_dim=8, attention_dropout=0.0),
           _tokens(), stages=3),
    Family("gpt_neo", "GPT-Neo (global and local attention)", "decoder",
           _hf("GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=100, hidden_size=32,
               num_layers=2, num_heads=4, intermediate_size=64, max_position_embeddings=64,
               attention_types=[[["global", "local"], 1]], window_size=4,
               embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0, use_cache=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=0),
           _tokens(), stages=2),
    Family("mbart", "mBART", "enc-dec",
           _hf("MBartForConditionalGeneration", "MBartConfig", **_BART),
           ("seq2seq", {"vocab": 100, "seq": 8, "start": 2}), stages=3),
    Family("umt5", "UMT5", "enc-dec",
           _hf("UMT5ForConditionalGeneration", "UMT5Config", vocab_size=100, d_model=32, d_kv=8,
               d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
               use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
           ("seq2seq", {"vocab": 100, "seq": 8, "start": 0}), stages=3),
    # casts its router to float32 in forward, and reads a mask it builds only when not
    # compiling: refused
    Family("switch_transformers", "Switch Transformers", "MoE",
           _hf("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig",
               vocab_size=100, d_model=32, d_kv=8, d_ff=64, expert_capacity=16, num_layers=2,
               num_sparse_encoder_layers=1, num_decoder_layers=2, num_sparse_decoder_layers=1,
               num_heads=4, num_experts=4, router_jitter_noise=0.0, dropout_rate=0.0,
               use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
           ("seq2seq", {"vocab": 100, "seq": 8, "start": 0}), stages=3),
    Family("squeezebert", "SqueezeBERT (grouped convolutions)", "encoder",
           _hf("SqueezeBertForMaskedLM", "SqueezeBertConfig", **_ENCODER, embedding_size=32),
           _tokens(), stages=2),
    Family("dinov2", "DINOv2", "vision",
           _hf("Dinov2ForImageClassification", "Dinov2Config", image_size=32, patch_size=8,
               hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               drop_path_rate=0.0, num_labels=10),
           ("image", {"size": 32, "key": "pixel_values", "classes": 10}), stages=3),
    Family("hubert", "HuBERT", "audio",
           _hf("HubertForSequenceClassification", "HubertConfig", **_AUDIO),
           ("waveform", {"samples": 400, "classes": 10}), stages=2),
    # Added on 2026-11-28: families tried as a new user would, chosen for architecture
    # ideas not yet here (local and n-gram attention in enc-decs, routed experts in an
    # enc-dec, a convolution front end before a speech enc-dec, rotary and character-level
    # encoders, sliding-window attention, an RNN, reversible layers with LSH attention,
    # dynamic-mask attention, shifted windows).
    # builds its attention mask only when not compiling, and without one its
    # transient-global bias does not broadcast over the batch: given one
    Family("longt5", "LongT5 (transient-global attention)", "enc-dec",
           _hf("LongT5ForConditionalGeneration", "LongT5Config", vocab_size=100, d_model=32,
               d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               local_radius=2, global_block_size=4, encoder_attention_type="transient-global",
               dropout_rate=0.0, use_cache=False, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=0),
           ("seq2seq_masked", {"vocab": 100, "seq": 8, "start": 0}), stages=3),
    Family("prophetnet", "ProphetNet (n-gram streams)", "enc-dec",
           _hf("ProphetNetForConditionalGeneration", "ProphetNetConfig", vocab_size=100,
               hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=2,
               num_decoder_layers=2, num_encoder_attention_heads=4,
               num_decoder_attention_heads=4, ngram=2, num_buckets=8, relative_max_distance=16,
               max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, decoder_start_token_id=2),
           ("seq2seq", {"vocab": 100, "seq": 8, "start": 2}), stages=3),
    # casts its router (module.to) in forward, then loops over the experts hit: refused
    Family("nllb_moe", "NLLB-MoE", "MoE",
           _hf("NllbMoeForConditionalGeneration", "NllbMoeConfig", **_BART, num_experts=4,
               expert_capacity=16, encoder_sparse_step=2, decoder_sparse_step=2,
               moe_token_dropout=0.0),
           ("seq2seq", {"vocab": 100, "seq": 8, "start": 2}), stages=3),
    # 32 frames of 16 features (the "mels" and "frames" fields give the shape's order)
    Family("speech2text", "Speech2Text (convolution subsampler)", "audio",
           _hf("Speech2TextForConditionalGeneration", "Speech2TextConfig", **_BART,
               max_source_positions=64, max_target_positions=32, num_conv_layers=2,
               conv_kernel_sizes=[5, 5], conv_channels=32, input_feat_per_channel=16,
               input_channels=1),
           ("speech2text", {"mels": 32, "frames": 16, "vocab": 100, "seq": 8, "start": 2}),
           stages=3),
    Family("esm", "ESM (rotary)", "encoder",
           _hf("EsmForMaskedLM", "EsmConfig", **_ENCODER, position_embedding_type="rotary",
               mask_token_id=3, emb_layer_norm_before=False, token_dropout=False),
           _tokens(), stages=2),
    # casts its extended attention mask (float64's smallest value) to float32, which
    # overflows to -inf: NaN in float64, so float32
    Family("canine", "CANINE (characters, downsampled, float32)", "encoder",
           _hf("CanineForTokenClassification", "CanineConfig", hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               max_position_embeddings=64, downsampling_rate=4, upsampling_kernel_size=4,
               num_hash_functions=4, num_hash_buckets=64, local_transformer_stride=4,
               num_labels=100),
           _tokens(), stages=2, dtype="float32"),
    # branches on whether any token attends globally (a tensor read as a bool): refused
    Family("longformer", "Longformer (sliding-window attention)", "encoder",
           _hf("LongformerForMaskedLM", "LongformerConfig", **_ENCODER, attention_window=4),
           _tokens(), stages=2),
    Family("rwkv", "RWKV", "RNN",
           _hf("RwkvForCausalLM", "RwkvConfig", vocab_size=100, hidden_size=32,
               num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
               context_length=64, rescale_every=0, use_cache=False, bos_token_id=1,
               eos_token_id=2),
           _tokens(), stages=2),
    # its reversible layers run under no_grad inside a torch.autograd.Function given the
    # layers, which a trace can only run through, without their gradients: refused
    # (fxpipe/tracing/functions.py); hash_seed makes LSH deterministic
    Family("reformer", "Reformer (LSH attention, reversible layers)", "decoder",
           _hf("ReformerModelWithLMHead", "ReformerConfig", vocab_size=100, hidden_size=32,
               num_attention_heads=4, attention_head_size=8, attn_layers=["local", "lsh"],
               feed_forward_size=64, axial_pos_embds=False, max_position_embeddings=64,
               local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=2,
               num_hashes=1, hash_seed=0, is_decoder=True, hidden_dropout_prob=0.0,
               local_attention_probs_dropout_prob=0.0,
               lsh_attention_probs_dropout_prob=0.0, use_cache=False, pad_token_id=0,
               eos_token_id=2),
           _tokens(), stages=2),
    Family("doge", "Doge (dynamic mask attention)", "decoder",
           _hf("DogeForCausalLM", "DogeConfig", **_DECODER, keep_window_size=4),
           _tokens(), stages=3),
    Family("ernie4_5_moe", "ERNIE-4.5-MoE", "MoE",
           _hf("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", **_DECODER,
               moe_intermediate_size=16, moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
               moe_layer_start_index=1, moe_layer_end_index=1,
               experts_implementation="batched_mm"),
           _tokens(), stages=3),
    Family("swin", "Swin (shifted windows)", "vision",
           _hf("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=2,
               embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, mlp_ratio=2.0,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               drop_path_rate=0.0, num_labels=10),
           ("image", {"size": 32, "key": "pixel_values", "classes": 10}), stages=3),
]


# The config fields that count layers, each 2 in the families above.
_LAYER_FIELDS = re.compile(r"\b((?:num_hidden_|num_encoder_|num_decoder_|encoder_|decoder_|"
                           r"num_|n_)layers?)=2\b")
# The config fields that list each layer's kind, as the families above write them:
# one kind per layer, or GPT-Neo's [[kinds, repeats], ...].
_KIND_LISTS = ("layers_block_type", "layer_types", "attention_types")


def deeper(family: Family, layers: int) -> Family:
    """``family`` with ``layers`` layers in each stack of its config instead of 2, and
    its lists of layer kinds cycled to as many."""
    build = _LAYER_FIELDS.sub(rf"\1={layers}", family.build)
    kind_lists = [node for node in ast.walk(ast.parse(build, mode="eval"))
                  if isinstance(node, ast.keyword) and node.arg in _KIND_LISTS]
    for keyword in sorted(kind_lists, key=lambda k: k.value.col_offset, reverse=True):
        kinds = ast.literal_eval(keyword.value)
        if keyword.arg == "attention_types":
            flat = [kind for group, repeats in kinds for _ in range(repeats) for kind in group]
            value = [[[flat[i % len(flat)] for i in range(layers)], 1]]
        else:
            value = [kinds[i % len(kinds)] for i in range(layers)]
        at, end = keyword.value.col_offset, keyword.value.end_col_offset
        build = f"{build[:at]}{value!r}{build[end:]}"
    return replace(family, build=build)


def _image(size: int) -> tuple[str, dict[str, Any]]:
    return ("image", {"size": size, "key": "x", "classes": 10})


_NO_STOCHASTIC_DEPTH = """\
    for module in model.modules():
        if isinstance(module, torchvision.ops.StochasticDepth):
            module.p = 0.0
"""

# Dropout and stochastic depth off (torchvision turns both on by default), so that the
# models are deterministic in training mode; BatchNorm stays on.
VISION = [
    Family("tv_resnet18", "torchvision resnet18", "vision",
           "torchvision.models.resnet18(num_classes=10)", _image(32), stages=3,
           imports="import torchvision"),
    Family("tv_mobilenet_v3_small", "torchvision mobilenet_v3_small", "vision",
           "torchvision.models.mobilenet_v3_small(num_classes=10, dropout=0.0)", _image(32),
           stages=3, imports="import torchvision"),
    Family("tv_efficientnet_b0", "torchvision efficientnet_b0", "vision",
           "torchvision.models.efficientnet_b0(num_classes=10, dropout=0.0,"
           " stochastic_depth_prob=0.0)", _image(32), stages=4, imports="import torchvision"),
    Family("tv_vit", "torchvision VisionTransformer (vit_b_16 layout, tiny)", "vision",
           "torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2,"
           " num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=10)", _image(32), stages=2,
           imports="import torchvision"),
    Family("tv_convnext_tiny", "torchvision convnext_tiny", "vision",
           "torchvision.models.convnext_tiny(num_classes=10, stochastic_depth_prob=0.0)",
           _image(32), stages=4, imports="import torchvision"),
    Family("tv_swin_t", "torchvision swin_t", "vision",
           "torchvision.models.swin_t(num_classes=10)", _image(32), stages=3,
           imports="import torchvision", setup=_NO_STOCHASTIC_DEPTH),  # swin_t fixes it
    Family("timm_efficientformerv2_s0", "timm efficientformerv2_s0", "vision",
           "timm.create_model('efficientformerv2_s0', pretrained=False, num_classes=10,"
           " img_size=64)", _image(64), stages=3, imports="import timm"),
    Family("timm_deit_tiny", "timm deit_tiny_patch16_224", "vision",
           "timm.create_model('deit_tiny_patch16_224', pretrained=False, num_classes=10,"
           " img_size=32)", _image(32), stages=3, imports="import timm"),
    Family("timm_resnet10t", "timm resnet10t", "vision",
           "timm.create_model('resnet10t', pretrained=False, num_classes=10)", _image(32),
           stages=2, imports="import timm"),
]

# --- one row -----------------------------------------------------------------


@dataclass
class Row:
    family: Family
    capture: str = "-"
    nodes: int = 0
    stages: int = 0
    solver: str = "-"  # the plan's solver status and partition()'s wall seconds
    output_diff: float | None = None
    grad_diff: float | None = None
    ruff: str = "-"  # what ruff says of the generated package ("-": ruff not installed)
    verdict: str = "fail"
    reason: str = ""  # why it failed, one line
    note: str = ""  # what a pass "(per micro-batch)" was compared with, and why
    seconds: float = 0.0


@dataclass
class Step:
    """What one training step of a mini-batch left: outputs (a forward under no_grad),
    the loss, every parameter's gradient and every buffer."""

    outputs: list[torch.Tensor]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


@dataclass
class Difference:
    output_abs: float  # the largest absolute difference of any output element
    grad_rel: float  # the largest relative difference of any gradient (see _grad_scale)
    problem: str | None  # the first difference beyond the tolerance, in words


def _one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:240]


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class Tolerance(NamedTuple):
    relative: float  # of a tensor's difference to its largest magnitude
    floor: float  # of the model's largest gradient: below it a gradient is rounding noise


def _tolerance(dtype: torch.dtype, precision: Precision | None = None) -> Tolerance:
    if precision is not None and precision.mixed:
        # bfloat16 keeps 8 bits (tests/codegen/test_precision_runner.py's RTOL); a
        # gradient that is zero up to rounding is noise of bfloat16's epsilon (float16's
        # is smaller)
        return Tolerance(2e-2, 2.0**-8)
    return Tolerance(1e-9 if dtype == torch.float64 else 1e-5, 1e-6)


def _relative(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    if not b.numel():
        return 0.0
    diff = (a.double() - b.double()).abs().max().item()
    scale = max(b.abs().max().item(), floor)
    return diff / scale if scale > 0 else diff


def _difference(got: Step, want: Step, tolerance: Tolerance) -> Difference:
    """How far ``got`` is from ``want``. A gradient is compared with its own largest
    magnitude, or with ``tolerance.floor`` of the model's largest gradient where it is
    smaller (1e-6 but in reduced precision): an
    attention key bias has a gradient of zero up to rounding (softmax ignores a shift),
    whose rounding noise is no difference of meaning."""
    problems: list[str] = []
    if len(got.outputs) != len(want.outputs):
        problems.append(f"{len(got.outputs)} output tensors, the model gives "
                        f"{len(want.outputs)}")
    output_abs = 0.0
    for i, (a, b) in enumerate(zip(got.outputs, want.outputs, strict=False)):
        if a.shape != b.shape:
            problems.append(f"output {i} has shape {tuple(a.shape)}, the model's "
                            f"{tuple(b.shape)}")
            continue
        output_abs = max(output_abs, (a.double() - b.double()).abs().max().item())
        if _relative(a, b) > tolerance.relative:
            problems.append(f"output {i} differs by {_relative(a, b):.2e} (relative)")
    if _relative(got.loss, want.loss) > tolerance.relative:
        problems.append(f"loss {float(got.loss):.12g}, the model's {float(want.loss):.12g}")
    largest = max((g.abs().max().item() for g in want.grads.values()
                   if g is not None and g.numel()), default=0.0)
    grad_rel, worst = 0.0, ""
    for key, b in want.grads.items():
        a = got.grads[key]
        if (a is None) != (b is None):
            problems.append(f"{key} has a gradient only "
                            f"{'in the model' if a is None else 'in the pipeline'}")
        elif (a is not None and b is not None
              and _relative(a, b, tolerance.floor * largest) > grad_rel):
            grad_rel, worst = _relative(a, b, tolerance.floor * largest), key
    if grad_rel > tolerance.relative:
        problems.append(f"the gradient of {worst} differs by {grad_rel:.2e} (relative)")
    for key, b in want.buffers.items():
        a = got.buffers[key]
        if not torch.equal(a, b) and (not b.is_floating_point()
                                      or _relative(a, b) > tolerance.relative):
            problems.append(f"buffer {key} differs after the step")
    return Difference(output_abs, grad_rel, problems[0] if problems else None)


# The rule set generated packages are held to (as tests/codegen/_models.py has it).
RUFF = ["check", "--isolated", "--no-cache", "--select", "E,F,W,I,B,UP,SIM,RUF,A",
        "--line-length", str(LINE_LENGTH), "--target-version", "py310", "."]


def _ruff(folder: Path) -> str:
    if importlib.util.find_spec("ruff") is None:
        return "-"
    done = subprocess.run([sys.executable, "-m", "ruff", *RUFF], capture_output=True,
                          text=True, cwd=folder)
    if done.returncode == 0:
        return "clean"
    problems = [line for line in done.stdout.splitlines()
                if line[:1].isupper() and not line.startswith("Found ")]
    return f"{len(problems) or 'some'} problems"


def _has_train_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
               for m in model.modules())


def _micro_slices(batch: dict[str, torch.Tensor], target: torch.Tensor
                  ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    for m in range(MICROBATCHES):
        rows = slice(m * MICRO, (m + 1) * MICRO)
        yield {k: v[rows] for k, v in batch.items()}, target[rows]


def _state(model: nn.Module) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    grads = {k: p.grad for k, p in model.named_parameters()}
    return grads, {k: b.detach().clone() for k, b in model.named_buffers()}


def _reference(model: nn.Module, batch: dict[str, torch.Tensor], target: torch.Tensor,
               loss_fn: Callable[[Any, Any], torch.Tensor], per_microbatch: bool,
               precision: Precision | None = None, scale: float = 1.0) -> Step:
    """The unsplit model's step, on the whole mini-batch or micro-batch by micro-batch
    (each micro-batch's loss divided by M, gradients accumulated); at a ``*-mixed``
    ``precision`` each forward and its loss under autocast, as the runner runs them;
    for ``16-mixed`` the loss multiplied by the runner's GradScaler ``scale`` before its
    backward (float16 gradients underflow without) and the gradients divided by it after."""

    def region() -> contextlib.AbstractContextManager[object]:
        if precision is None or not precision.mixed:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=precision.dtype)

    if not per_microbatch:
        with region():
            loss = loss_fn(model(**batch), target)
        (loss * scale).backward()
        grads, buffers = _state(model)
        with torch.no_grad(), region():
            outputs = _leaves(model(**batch))
        return Step(outputs, loss.detach(), _unscaled(grads, scale), buffers)
    losses, parts = [], []
    for micro, micro_target in _micro_slices(batch, target):
        with region():
            loss = loss_fn(model(**micro), micro_target) / MICROBATCHES
        (loss * scale).backward()
        losses.append(loss.detach())
    grads, buffers = _state(model)
    grads = _unscaled(grads, scale)
    for micro, _ in _micro_slices(batch, target):
        with torch.no_grad(), region():
            parts.append(_leaves(model(**micro)))
    outputs = [torch.cat(column) for column in zip(*parts, strict=True)]
    return Step(outputs, torch.stack(losses).sum(), grads, buffers)


def _unscaled(grads: dict[str, torch.Tensor | None], scale: float
              ) -> dict[str, torch.Tensor | None]:
    """Gradients of a loss multiplied by ``scale`` (a power of two: exact), divided by it."""
    return {k: None if g is None else g / scale for k, g in grads.items()}


def _check_deterministic(module: Any) -> None:
    """Two builds of the model give the same weights and, in training mode, the same
    output: else a mismatch would be the model's randomness (dropout), not fxpipe's."""
    a, b = module.build_model(), module.build_model()
    inputs = module.example_inputs()
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        if not torch.equal(x, y):
            raise Mismatch(f"two builds differ in {key}: the model file is not seeded")
    with torch.no_grad():
        first, second = _leaves(a(**inputs)), _leaves(a(**inputs))
    if any(not torch.equal(x, y) for x, y in zip(first, second, strict=True)):
        raise Mismatch("the model is random in training mode (dropout?): fix its config")


class Mismatch(AssertionError):
    """The pipeline computed something else than the model."""


def _verdict(row: Row, piped: Step, whole: Step, micro: Step, batchnorm: bool,
             tolerance: Tolerance, autocast: bool = False) -> None:
    """Pass against the model on the whole mini-batch; or, where the model itself gives
    another answer micro-batch by micro-batch (BatchNorm's statistics; float32 inside a
    float64 model, summed in another order), against the model run that way; under
    ``autocast``, always so (the runner opens one autocast region per micro-batch)."""
    full = _difference(piped, whole, tolerance)
    by_micro = _difference(piped, micro, tolerance)
    itself = _difference(micro, whole, tolerance)
    per_micro = batchnorm or autocast
    if full.problem is None and not per_micro:
        row.output_diff, row.grad_diff, row.verdict = full.output_abs, full.grad_rel, "pass"
        return
    if by_micro.problem is None and (per_micro or itself.problem is not None):
        row.note = ("BatchNorm in training mode: statistics per micro-batch, as in GPipe" if
                    batchnorm else "under autocast, one region per micro-batch" if autocast
                    else f"the model itself differs between the whole mini-batch and its "
                    f"micro-batches ({itself.problem}): it computes in float32 inside")
        row.output_diff, row.grad_diff = by_micro.output_abs, by_micro.grad_rel
        row.verdict = "pass (per micro-batch)"
        return
    closest = by_micro if per_micro else full
    row.output_diff, row.grad_diff = closest.output_abs, closest.grad_rel
    raise Mismatch(closest.problem or full.problem)


def kept_by_level(plan: Plan, levels: tuple[tuple[int, int], ...], level: int) -> Plan:
    """``plan`` with each selective stage keeping by the model's keep level ``level`` (0:
    the fewest outputs kept; past the last, the last: all) instead of the one planned, so
    that the runtime's keep rules, not only keep-all, are checked on every family."""
    rule = levels[min(level, len(levels) - 1)]
    return replace(plan, stages=tuple(
        replace(stage, keeps=rule) if stage.recompute is StageRecompute.SELECTIVE else stage
        for stage in plan.stages))


def check(family: Family, folder: Path, schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
          virtual_stages: int = 1, precision: Precision | None = None,
          recompute: Recompute = Recompute.AUTO, keep_level: int | None = None) -> Row:
    """Split ``family`` as ``fxpipe split`` would and compare the pipeline with the model
    (at ``precision``: a ``*-mixed`` one traces and runs the float32 model under autocast,
    and the model is run so too, micro-batch by micro-batch; ``keep_level``: see
    ``kept_by_level``)."""
    row = Row(family)
    if precision is not None and precision.mixed:
        family = replace(family, dtype="float32")
    start = time.perf_counter()
    phase = "write"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        model_file = folder / "model.py"
        model_file.write_text(family.source(), encoding="utf-8")

        phase = "trace"  # load, trace and analyse, as `fxpipe split model.py` does
        device = get_device("h100")
        source, traced = analyze_file(str(model_file), device=device, solvable=True,
                                       precision=precision)
        copied = next((found for note in traced.notes
                       if (found := re.match(r"exported (\d+) layers", note))), None)
        row.capture = (f"{traced.tracer}, copied {copied.group(1)} deep" if copied
                       else traced.tracer)
        row.nodes = sum(1 for n in traced.gm.graph.nodes if n.op in OP_NODES)

        phase = "plan"
        options = SplitOptions(gpus=family.stages, device=device,
                               memory_limit=float(device.memory_bytes),
                               microbatches=MICROBATCHES, time_limit_s=60,
                               schedule=schedule, virtual_stages=virtual_stages,
                               precision=precision, recompute=recompute)
        plan = plan_split(traced, label=source.label, options=options)
        if keep_level is not None:
            plan = kept_by_level(plan, _lowered(traced, options).problem.keep_levels,
                                 keep_level)
        row.stages = plan.num_stages
        row.solver = f"{plan.solver.status} {plan.solver.wall_s:.2f} s"

        phase = "codegen"
        write_folder(folder / "pipe", output_files(traced, plan, label=source.label),
                     force=True)
        package = load_package(folder / "pipe")
        row.ruff = _ruff(folder / "pipe")

        phase = "check"
        module = import_file(model_file, f"zoo_{family.slug}")
        _check_deterministic(module)
        batch, target = module.make_batch(MICRO * MICROBATCHES, 1)
        loss_fn = module.loss_fn
        model = source.model
        dtype = next(model.parameters()).dtype
        batchnorm = _has_train_batchnorm(model)

        phase = "run"
        runner = package.PipelineRunner(package.build_stages(model))
        model.zero_grad(set_to_none=True)
        scale = runner.scaler.get_scale() if runner.scaler is not None else 1.0
        loss = torch.as_tensor(runner.step(batch, target, loss_fn)).detach()
        grads, buffers = _state(model)
        grads = _unscaled(grads, scale)
        with torch.no_grad():
            outputs = _leaves(runner.forward(**batch))
        piped = Step(outputs, loss, grads, buffers)

        phase = "compare"
        whole = _reference(module.build_model(), batch, target, loss_fn, False, precision, scale)
        micro = _reference(module.build_model(), batch, target, loss_fn, True, precision, scale)
        _verdict(row, piped, whole, micro, batchnorm, _tolerance(dtype, precision),
                 autocast=precision is not None and precision.mixed)
    except Exception as exc:
        row.reason = f"{phase}: {_one_line(exc)}"
        if os.environ.get("ZOO_DEBUG"):
            traceback.print_exc()
    row.seconds = time.perf_counter() - start
    return row


# --- the table ---------------------------------------------------------------

HEADER = ("| family | kind | capture | nodes | stages | solver | max abs output diff | "
          "max rel grad diff | ruff | verdict | seconds |")


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def markdown(rows: list[Row]) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in rows:
        verdict = r.verdict if not r.reason else f"**fail**: {r.reason}".replace("|", "\\|")
        lines.append(
            f"| {r.family.name} | {r.family.kind} | {r.capture} | {r.nodes or '-'} | "
            f"{r.stages or '-'} | {r.solver} | {_figure(r.output_diff)} | {_figure(r.grad_diff)} | "
            f"{r.ruff} | {verdict} | {r.seconds:.1f} |")
    return "\n".join(lines)


def _vision_missing() -> str | None:
    missing = []
    for name in ("torchvision", "timm"):
        try:
            __import__(name)
        except Exception as exc:  # an import that fails to load its ops counts as missing
            missing.append(f"{name} ({_one_line(exc)})")
    return ", ".join(missing) or None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vision", action="store_true",
                        help="the torchvision / timm models instead of the transformers ones")
    parser.add_argument("--only", help="comma-separated slugs to run (default: all)")
    parser.add_argument("--layers", type=int, default=2,
                        help="layers per stack of the transformers configs (default 2)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="stages for every family (default: each family's own, 2-4)")
    parser.add_argument("--schedule", type=ScheduleKind, default=ScheduleKind.ONE_F_ONE_B,
                        choices=list(ScheduleKind), metavar="SCHEDULE",
                        help="the pipeline schedule (default 1f1b)")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="stage modules per GPU for --schedule interleaved (default 1; "
                        "2 for the schedules that place two in a V)")
    parser.add_argument("--precision", type=parse_precision, default=None,
                        help="plan and train at this precision (default: the model's, "
                        "float64); a *-mixed one builds the models in float32")
    parser.add_argument("--recompute", type=Recompute, default=Recompute.AUTO,
                        choices=list(Recompute), metavar="RECOMPUTE",
                        help="which stages run their forward again in backward (default "
                        "auto, which at 80 GiB recomputes none; all: every stage in full; "
                        "selective: every stage selectively)")
    parser.add_argument("--keep-level", type=int, default=None, metavar="L",
                        help="every selective stage keeps by the model's keep level L (0: "
                        "the fewest outputs), not the planned one; with --recompute "
                        "selective, every stage")
    parser.add_argument("--padded", action="store_true",
                        help="give the token models an attention_mask, half the samples "
                        "padded on the left (the families without one are left out)")
    parser.add_argument("--keep", type=Path,
                        help="write the model files and packages here (default: a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core: the machine is shared

    families = VISION if args.vision else TRANSFORMERS
    if args.vision and (missing := _vision_missing()):
        print(f"zoo: skipping the vision part: {missing} not importable; install torchvision "
              "and timm in a separate environment (see BENCHMARKS.md, Model zoo)")
        return 0
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {f.slug for f in families}
        if unknown:
            parser.error(f"unknown families {sorted(unknown)}; choose from "
                         f"{', '.join(f.slug for f in families)}")
        families = [f for f in families if f.slug in wanted]
    if args.layers != 2:
        families = [deeper(f, args.layers) for f in families]
    if args.padded:
        families = [replace(f, inputs=("tokens_padded", f.inputs[1])) for f in families
                    if f.inputs[0] == "tokens"]
    if args.gpus is not None:
        families = [replace(f, stages=args.gpus) for f in families]

    virtual_stages = args.virtual_stages or (2 if args.schedule.spec.v_placed else 1)
    with tempfile.TemporaryDirectory(prefix="fxpipe-zoo-") as tmp:
        base = args.keep or Path(tmp)
        rows = []
        for family in families:
            row = check(family, base / family.slug, args.schedule, virtual_stages,
                        args.precision, args.recompute, args.keep_level)
            rows.append(row)
            print(f"{family.slug}: {row.verdict if not row.reason else row.reason} "
                  f"({row.seconds:.1f} s)", file=sys.stderr, flush=True)
    print(markdown(rows))
    notes = [f"- {r.family.name}: {r.note}" for r in rows if r.note]
    if notes:
        print("\n\"per micro-batch\": compared with the unsplit model run micro-batch by "
              "micro-batch (gradients accumulated), because\n" + "\n".join(notes))
    passed = sum(not r.reason for r in rows)
    print(f"\n{passed} of {len(rows)} transparent")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
