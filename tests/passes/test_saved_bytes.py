"""The plan's activation bytes against what autograd really saves on this CPU.

One stage, one micro-batch, ``--device cpu``: the plan's ``activations`` for the stage
must be within 10% of the bytes autograd keeps for backward (unique storages seen by
``saved_tensors_hooks``, parameters excluded) in a real forward of the traced graph,
the graph the generated stages run, in float32 and under bf16 autocast.

The real forward runs the traced graph rather than the eager model: torch.export records
transformers' Llama with its causal mask materialised (eager transformers skips the mask
and passes ``is_causal``/``enable_gqa``), so the graph keeps an L×L mask per layer and the
repeated k/v heads that eager does not.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx

from fxpipe.compiler import SplitOptions, analyze, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import Traced, trace
from fxpipe.precision import Precision
from tests.passes.test_flops import import_example

CPU = get_device("cpu")


def real_saved_bytes(traced: Traced, autocast: torch.dtype | None) -> int:
    """Bytes of the unique storages autograd saves in one real forward of the graph."""
    params = {p.untyped_storage().data_ptr() for p in traced.gm.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    mixed = torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mixed:
        torch.fx.Interpreter(traced.gm).run(*traced.flat_inputs)
    return sum(storages.values())


def planned_activation_bytes(traced: Traced, precision: Precision | None) -> int:
    analyze(traced, device=CPU, precision=precision)
    options = SplitOptions(gpus=1, device=CPU, memory_limit=float("inf"), microbatches=1,
                           precision=precision, time_limit_s=5.0)
    plan = plan_split(traced, label="test", options=options)
    assert plan.precision == (precision or Precision.TRUE_32).value
    return plan.stages[0].memory.activations


@functools.cache
def llama(width: int, seq: int) -> Traced:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
        use_cache=False,
    )
    model = LlamaForCausalLM(config).train()
    return trace(model, (), {"input_ids": torch.randint(0, 512, (1, seq))})


@functools.cache
def hand_written_gpt(width: int, seq: int) -> Traced:
    gpt = import_example("gpt")
    config = gpt.GPTConfig(n_layer=2, n_embd=width, n_head=4, block_size=seq, seq_len=seq,
                           batch_size=1)
    torch.manual_seed(0)
    model = gpt._build(config)
    return trace(model, (torch.randint(0, 1000, (1, seq)),))


SIZES = [(64, 128), (128, 512), (256, 256)]
PRECISIONS = [None, Precision.BF16_MIXED]


@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize(("width", "seq"), SIZES)
def test_llama_activations_match_autograd(width: int, seq: int,
                                          precision: Precision | None) -> None:
    traced = llama(width, seq)
    planned = planned_activation_bytes(traced, precision)
    real = real_saved_bytes(traced, precision.dtype if precision else None)
    assert planned == pytest.approx(real, rel=0.10), (planned / 2**20, real / 2**20)


@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize(("width", "seq"), [(64, 128), (128, 256)])
def test_hand_written_attention_matches_autograd(width: int, seq: int,
                                                 precision: Precision | None) -> None:
    traced = hand_written_gpt(width, seq)
    planned = planned_activation_bytes(traced, precision)
    real = real_saved_bytes(traced, precision.dtype if precision else None)
    assert planned == pytest.approx(real, rel=0.10), (planned / 2**20, real / 2**20)
