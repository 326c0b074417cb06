"""The plan's activation bytes against what autograd really saves on this CPU.

One stage, one micro-batch, ``--device cpu``: the plan's ``activations`` for the stage
must be within 2% of the bytes autograd keeps for backward (unique storages seen by
``saved_tensors_hooks``; parameters, buffers and the graph's inputs left out) in a real
forward of the traced graph, the graph the generated stages run, in float32 and under
bf16 autocast. (Issue 14 asks for 10%; the plans are within 0.1%, so 2% catches a
regression.)

The real forward runs the traced graph rather than the eager model: torch.export records
transformers' Llama with its causal mask materialised (eager transformers skips the mask
and passes ``is_causal``/``enable_gqa``), so the graph keeps an L×L mask per layer and the
repeated k/v heads that eager does not.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.fx
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from fxpipe import meta
from fxpipe.compiler import SplitOptions, analyze, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import Traced, trace
from fxpipe.lower import keep_levels
from fxpipe.plan import Plan
from fxpipe.precision import Precision
from fxpipe.runtime.recompute import KEEP_ALL, KeepRule, keeping
from tests.passes.test_flops import import_example

CPU = get_device("cpu")
TOLERANCE = 0.02


def real_saved_bytes(traced: Traced, autocast: torch.dtype | None = None) -> int:
    """Bytes of the unique storages autograd keeps in one real forward of the graph,
    parameters, buffers and the graph's inputs left out (the plan counts a stage's
    inputs as received, not as its activations)."""
    skip = {t.untyped_storage().data_ptr()
            for t in (*traced.gm.parameters(), *traced.gm.buffers(), *traced.flat_inputs)
            if isinstance(t, torch.Tensor)}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    mixed = torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mixed:
        torch.fx.Interpreter(traced.gm).run(*traced.flat_inputs)
    return sum(storages.values())


def real_selective_bytes(traced: Traced, autocast: torch.dtype | None = None,
                         rule: KeepRule = KEEP_ALL) -> int:
    """Bytes of the unique storages torch's SAC, under the runtime's policy keeping by
    ``rule`` (``keeping``), keeps in one forward of the graph: what its cache holds,
    parameters, buffers and inputs left out."""
    skip = {t.untyped_storage().data_ptr()
            for t in (*traced.gm.parameters(), *traced.gm.buffers(), *traced.flat_inputs)
            if isinstance(t, torch.Tensor)}
    contexts = []

    def context() -> Any:
        contexts.append(create_selective_checkpoint_contexts(keeping(rule)))
        return contexts[-1]

    mixed = torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None)
    with mixed:
        checkpoint(lambda *xs: torch.fx.Interpreter(traced.gm).run(*xs), *traced.flat_inputs,
                   use_reentrant=False, context_fn=context)
    storages: dict[int, int] = {}
    for entries in contexts[0][0].storage.values():  # op -> {call: its cached outputs}
        for entry in entries.values():
            for wrapper in entry if isinstance(entry, tuple | list) else [entry]:
                value = getattr(wrapper, "val", None)  # a recomputed op holds a sentinel
                if isinstance(value, torch.Tensor):
                    storage = value.untyped_storage()
                    if storage.data_ptr() not in skip:
                        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _one_stage(traced: Traced, precision: Precision | None) -> Plan:
    options = SplitOptions(gpus=1, device=CPU, memory_limit=float("inf"), microbatches=1,
                           precision=precision, time_limit_s=5.0)
    return plan_split(traced, label="test", options=options)


def planned_activations(traced: Traced, precision: Precision | None = None) -> int:
    """The activation bytes of an analysed graph planned onto one stage, ``--device cpu``,
    one micro-batch."""
    return _one_stage(traced, precision).stages[0].memory.activations


def planned_activation_bytes(traced: Traced, precision: Precision | None) -> int:
    """``planned_activations`` of a float32 model, analysed here at ``precision``."""
    analyze(traced, device=CPU, precision=precision)
    plan = _one_stage(traced, precision)
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
    assert planned == pytest.approx(real, rel=TOLERANCE), (planned / 2**20, real / 2**20)


@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize(("width", "seq"), [(64, 128), (128, 256)])
def test_hand_written_attention_matches_autograd(width: int, seq: int,
                                                 precision: Precision | None) -> None:
    traced = hand_written_gpt(width, seq)
    planned = planned_activation_bytes(traced, precision)
    real = real_saved_bytes(traced, precision.dtype if precision else None)
    assert planned == pytest.approx(real, rel=TOLERANCE), (planned / 2**20, real / 2**20)


@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize(("width", "seq"), [(64, 128), (128, 512)])
def test_what_selective_recompute_keeps_matches_torchs_sac(width: int, seq: int,
                                                           precision: Precision | None) -> None:
    """The memory pass's bytes kept by selective recompute (the matmuls' and attention's
    outputs, as the runtime's SAC policy names the ops) against what torch's SAC keeps
    under that policy in a real forward; about half of what a full forward saves."""
    traced = llama(width, seq)
    analyze(traced, device=CPU, precision=precision)
    planned = sum(meta.BYTES.get(n).selective_bytes for n in traced.gm.graph.nodes
                  if meta.BYTES.get(n) is not None)
    dtype = precision.dtype if precision else None
    real = real_selective_bytes(traced, dtype)
    assert planned == pytest.approx(real, rel=TOLERANCE), (planned / 2**20, real / 2**20)
    assert 0.3 < real / real_saved_bytes(traced, dtype) < 0.7


@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16-mixed"])
def test_each_keep_level_keeps_what_torchs_sac_keeps_by_its_rule(
        precision: Precision | None) -> None:
    """A selective stage may keep only the outputs that cost the most to run again per
    byte (a keep level's rule): at every level the model offers, the memory pass's bytes
    equal what torch's SAC keeps under the runtime's policy for that rule, and the levels
    keep more and more, the last all."""
    traced = llama(128, 512)
    analyze(traced, device=CPU, precision=precision)
    kept = [k for n in traced.gm.graph.nodes if meta.BYTES.get(n) is not None
            for k in meta.BYTES.get(n).selective]
    levels = keep_levels(kept)
    assert len(levels) >= 3 and levels[-1] == (0, 0)  # e.g. down_proj, attention, ..., all
    dtype = precision.dtype if precision else None
    real = [real_selective_bytes(traced, dtype, KeepRule(*level)) for level in levels]
    planned = [sum(k.nbytes for k in kept if KeepRule(*level).keeps(k.work, k.width))
               for level in levels]
    assert planned == real
    assert real == sorted(real) and real[0] > 0 and len(set(real)) == len(real)


@functools.cache
def torch_encoder(norm_first: bool, dropout: float) -> Traced:
    """``torch.nn.TransformerEncoder``: attention inside ``F.multi_head_attention_forward``,
    its q, k, v views of one projection, a reshape that views the attention output, and a
    dropout of p = 0 that returns its input."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=dropout, batch_first=True,
                                             norm_first=norm_first)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train()
    return trace(model, (torch.randn(2, 256, 128),))


@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize(("norm_first", "dropout"), [(False, 0.0), (True, 0.1)],
                         ids=["post-norm", "pre-norm-dropout"])
def test_torch_transformer_encoder_matches_autograd(norm_first: bool, dropout: float,
                                                    precision: Precision | None) -> None:
    """Each storage once, however many views of it backward keeps (1.3-1.4x before), and
    attention with dropout as the CPU runs it: the math path (0.35-0.47x before)."""
    traced = torch_encoder(norm_first, dropout)
    planned = planned_activation_bytes(traced, precision)
    real = real_saved_bytes(traced, precision.dtype if precision else None)
    assert planned == pytest.approx(real, rel=TOLERANCE), (planned / 2**20, real / 2**20)


class _SliceOfWide(torch.nn.Module):
    """Backward keeps an 8-column view of a 1024-column result: all of it stays alive."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = torch.nn.Linear(64, 1024)
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.wide(x)[:, :8] * self.scale).sum(-1)


def test_a_kept_view_keeps_its_whole_storage() -> None:
    x = torch.randn(256, 64)
    traced = trace(_SliceOfWide(), (x,))
    planned = planned_activation_bytes(traced, None)
    real = real_saved_bytes(traced, None)
    assert planned == real == 256 * 1024 * 4  # the input the Linear keeps is received
