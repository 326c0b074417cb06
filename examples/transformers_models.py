"""Hugging Face transformers models with RANDOM weights from small configs.

Nothing is downloaded: every model is built from a config object. Dropout is
set to 0 in every config, so the models stay in training mode (as fxpipe
trains them) and are still deterministic; ``use_cache=False`` where the config
has it; bos/eos/pad token ids lie inside the vocabulary.

``torch.fx.symbolic_trace`` cannot trace these models (transformers 5.x);
fxpipe captures them with ``torch.export.export(model, (), kwargs, strict=False)``,
so every ``example_inputs`` here is a keyword dict.

Each model also has its own file (``hf_gpt2.py``, ``hf_llama.py``, ``hf_bert.py``,
``hf_t5.py``, ``hf_vit.py``) that follows the model-file contract with
``build_model``; this module is the catalogue they share. Used directly,
``build_model`` is GPT-2 and the others are named factories, e.g.
``fxpipe split examples/transformers_models.py:build_t5 --gpus 2``; each factory
carries its own ``example_inputs`` / ``example_target`` attributes, the
module-level ``example_inputs()`` / ``example_target()`` describe whichever
factory was called last, and ``MODELS`` maps a short name to
(factory, inputs, target).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 1000
BATCH = 2
SEQ = 32
IMAGE_SIZE = 32
NUM_LABELS = 10


def _ids(seed: int, shape: tuple[int, ...] = (BATCH, SEQ), high: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # ids start at 3 so that no example token is pad/bos/eos
    return torch.randint(3, high, shape, generator=g)


def _next_token_pair() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: a ModelOutput, a dict (what a traced graph
    may return), a tuple/list (logits first) or a bare tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):  # ModelOutput is an OrderedDict too
        return output["logits"]
    if hasattr(output, "logits"):
        return output.logits
    return output[0]


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against class / token ids (any leading shape)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


# --- GPT-2 -------------------------------------------------------------------


def _make_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(cfg).train()


def gpt2_inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": _next_token_pair()[0]}


def gpt2_target() -> torch.Tensor:
    return _next_token_pair()[1]


# --- Llama -------------------------------------------------------------------


def _make_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=0.0,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).train()


llama_inputs = gpt2_inputs
llama_target = gpt2_target


# --- BERT (masked LM head) ---------------------------------------------------


def _make_bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        use_cache=False,
        pad_token_id=0,
    )
    return BertForMaskedLM(cfg).train()


def bert_inputs() -> dict[str, torch.Tensor]:
    return {
        "input_ids": _ids(1),
        "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
        "token_type_ids": torch.zeros(BATCH, SEQ, dtype=torch.long),
    }


def bert_target() -> torch.Tensor:
    return _ids(2)  # a token id to predict at every position


# --- T5 (encoder-decoder) ----------------------------------------------------


def _make_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        classifier_dropout=0.0,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(cfg).train()


def _t5_decoder_pair() -> tuple[torch.Tensor, torch.Tensor]:
    labels = _ids(2, (BATCH, SEQ // 2))
    # teacher forcing: decoder input = labels shifted right, starting with the start token
    start = torch.zeros(BATCH, 1, dtype=torch.long)
    return torch.cat([start, labels[:, :-1]], dim=1), labels


def t5_inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(1), "decoder_input_ids": _t5_decoder_pair()[0]}


def t5_target() -> torch.Tensor:
    return _t5_decoder_pair()[1]


# --- ViT (image classification) ----------------------------------------------


def _make_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(
        image_size=IMAGE_SIZE,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=NUM_LABELS,
    )
    return ViTForImageClassification(cfg).train()


def vit_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)}


def vit_target() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, NUM_LABELS, (BATCH,), generator=g)


# --- the catalogue -----------------------------------------------------------

# name -> (example_inputs, example_target)
_EXAMPLES = {
    "gpt2": (gpt2_inputs, gpt2_target),
    "llama": (llama_inputs, llama_target),
    "bert": (bert_inputs, bert_target),
    "t5": (t5_inputs, t5_target),
    "vit": (vit_inputs, vit_target),
}
_built = ["gpt2"]  # the model the module-level example_* functions describe


def _factory(name: str, make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        _built[0] = name
        return make()

    build.__name__ = build.__qualname__ = f"build_{name}"
    # a frontend may prefer a factory's own micro-batch when it has one
    build.example_inputs, build.example_target = _EXAMPLES[name]  # type: ignore[attr-defined]
    return build


build_gpt2 = _factory("gpt2", _make_gpt2)
build_llama = _factory("llama", _make_llama)
build_bert = _factory("bert", _make_bert)
build_t5 = _factory("t5", _make_t5)
build_vit = _factory("vit", _make_vit)
build_model = build_gpt2

# name -> (factory, example_inputs, example_target)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict], Callable[[], torch.Tensor]]]
MODELS = {
    name: (factory, *_EXAMPLES[name])
    for name, factory in [
        ("gpt2", build_gpt2),
        ("llama", build_llama),
        ("bert", build_bert),
        ("t5", build_t5),
        ("vit", build_vit),
    ]
}


# ``fxpipe split transformers_models.py:build_t5`` calls build_t5() and then the
# module-level example_inputs(): these follow whichever factory was called last.
def example_inputs() -> dict[str, torch.Tensor]:
    """The micro-batch of the factory called last (GPT-2 before any)."""
    return _EXAMPLES[_built[0]][0]()


def example_target() -> torch.Tensor:
    return _EXAMPLES[_built[0]][1]()
