"""FLOP counts against closed forms: one Linear exactly, GPT-2 small within 1%.

Legend: b batch, s sequence length, t = b·s tokens, d width, v vocabulary, n layers.
A linear layer in -> out costs 2·t·in·out forward; its backward costs the same for
the weight gradient and the same again for the input gradient when the input
requires grad. Attention costs 4·b·s²·d per layer forward (scores q·kᵀ and the
weighted sum of values, 2·b·s²·d each); FLOP counting counts the full s×s matrix,
masked or not.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch
import torch.fx
from torch import nn

from fxpipe import meta
from fxpipe.frontend import trace
from fxpipe.passes import annotate_all, annotate_flops

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def import_example(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"fxpipe_test_example_{name}", EXAMPLES / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


our_gpt = import_example("gpt")


def total_flops(gm: torch.fx.GraphModule) -> tuple[int, int]:
    records = [meta.FLOPS.get(n) for n in gm.graph.nodes]
    return sum(r.forward for r in records), sum(r.backward for r in records)


def gpt_forward_closed_form(*, b: int, s: int, d: int, v: int, n: int) -> int:
    """Every linear (qkv d->3d, proj d->d, fc d->4d, proj 4d->d, LM head d->v) + attention."""
    t = b * s
    linears_per_layer = 2 * t * (d * 3 * d + d * d + d * 4 * d + 4 * d * d)
    attention_per_layer = 4 * b * s * s * d
    return n * (linears_per_layer + attention_per_layer) + 2 * t * d * v


# ------------------------------------------------------------------ one Linear, exactly

IN, OUT, BATCH = 1024, 4096, 8
LINEAR_FORWARD = 2 * BATCH * IN * OUT


def linear_flops(input_requires_grad: bool) -> tuple[int, int]:
    gm = torch.fx.symbolic_trace(nn.Linear(IN, OUT))
    x = torch.randn(BATCH, IN, requires_grad=input_requires_grad)
    annotate_all(gm, x)
    return total_flops(gm)


def test_linear_forward_and_backward_exact() -> None:
    forward, backward = linear_flops(input_requires_grad=True)
    assert forward == LINEAR_FORWARD == 67_108_864
    assert backward == 2 * LINEAR_FORWARD, "weight gradient + input gradient"


def test_linear_backward_without_input_grad_is_weight_gradient_only() -> None:
    forward, backward = linear_flops(input_requires_grad=False)
    assert forward == LINEAR_FORWARD
    assert backward == LINEAR_FORWARD


# ------------------------------------------------------------------ GPT-2 small on meta

GPT2 = {"b": 1, "s": 512, "d": 768, "v": 50257, "n": 12}


def hf_gpt2_small_on_meta() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(  # GPT-2 small; dropout 0 so the graph is the training graph minus noise
        n_embd=GPT2["d"],
        n_layer=GPT2["n"],
        n_head=12,
        vocab_size=GPT2["v"],
        n_positions=1024,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg).train()


def check_against_closed_form(gm: torch.fx.GraphModule, label: str, **shape: int) -> None:
    forward, backward = total_flops(gm)
    expected = gpt_forward_closed_form(**shape)
    step = forward + backward
    report = (
        f"{label} {shape}: forward {forward:,} vs closed form {expected:,} "
        f"({forward / expected - 1:+.3%}); forward+backward {step:,} = "
        f"{step / forward:.4f} x forward"
    )
    print(report)
    assert abs(forward / expected - 1) < 0.01, report
    assert abs(step / (3 * forward) - 1) < 0.02, report


@pytest.fixture(scope="module")
def hf_gpt2_small() -> tuple[torch.nn.Module, torch.fx.GraphModule]:
    """transformers' GPT-2 small on meta, exported and its FLOPs counted (5-8 s of a
    2-core machine, so once for the tests that read it)."""
    model = hf_gpt2_small_on_meta()
    ids = torch.zeros(GPT2["b"], GPT2["s"], dtype=torch.long)
    traced = trace(model, (), {"input_ids": ids})
    assert traced.tracer == "export"
    annotate_flops(traced.gm, *traced.flat_inputs)
    return model, traced.gm


def test_hf_gpt2_small_flops_match_closed_form(
        hf_gpt2_small: tuple[torch.nn.Module, torch.fx.GraphModule]) -> None:
    model, gm = hf_gpt2_small
    check_against_closed_form(gm, "transformers GPT-2 small", **GPT2)
    assert all(p.is_meta for p in model.parameters())


def test_our_gpt_small_flops_match_closed_form() -> None:
    cfg = our_gpt.SMALL
    traced = trace(our_gpt.build_model(), our_gpt.example_inputs())
    assert traced.tracer == "symbolic_trace"
    annotate_flops(traced.gm, *traced.flat_inputs)
    check_against_closed_form(
        traced.gm,
        "examples/gpt.py build_model",
        b=cfg.batch_size,
        s=cfg.seq_len,
        d=cfg.n_embd,
        v=cfg.vocab_size,
        n=cfg.n_layer,
    )


def test_our_gpt2_small_on_meta_flops_match_closed_form() -> None:
    cfg = our_gpt.GPT2_SMALL
    traced = trace(our_gpt.build_gpt2_small(), our_gpt.example_inputs_gpt2_small())
    annotate_flops(traced.gm, *traced.flat_inputs)
    check_against_closed_form(
        traced.gm,
        "examples/gpt.py build_gpt2_small",
        b=cfg.batch_size,
        s=cfg.seq_len,
        d=cfg.n_embd,
        v=cfg.vocab_size,
        n=cfg.n_layer,
    )


# ------------------------------------------------------------------ B and W apart


def linear_split(input_requires_grad: bool) -> list[meta.FlopInfo]:
    gm = torch.fx.symbolic_trace(nn.Linear(IN, OUT))
    x = torch.randn(BATCH, IN, requires_grad=input_requires_grad)
    annotate_all(gm, x)
    return [meta.FLOPS.get(n) for n in gm.graph.nodes if meta.FLOPS.get(n).forward]


def test_linear_backward_splits_into_input_and_weight_gemms() -> None:
    (record,) = linear_split(input_requires_grad=True)
    assert record.backward_weight == LINEAR_FORWARD, "dW = dY^T X: one GEMM"
    assert record.backward_input == LINEAR_FORWARD, "dX = dY W: the other"
    assert record.weight_share == 0.5


def test_linear_without_input_grad_is_all_weight_gradient() -> None:
    (record,) = linear_split(input_requires_grad=False)
    assert record.backward_input == 0
    assert record.backward_weight == record.backward == LINEAR_FORWARD


def test_conv_backward_splits_like_a_linear() -> None:
    gm = torch.fx.symbolic_trace(nn.Conv2d(8, 16, 3, padding=1, bias=False))
    annotate_all(gm, torch.randn(2, 8, 12, 12, requires_grad=True))
    (record,) = [meta.FLOPS.get(n) for n in gm.graph.nodes if meta.FLOPS.get(n).forward]
    assert record.backward_weight == record.forward > 0
    assert record.backward_input == record.forward


def test_matmul_of_two_activations_is_all_input_gradient() -> None:
    class Scores(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return q @ k.transpose(-1, -2)

    gm = torch.fx.symbolic_trace(Scores())
    q = torch.randn(2, 16, 8, requires_grad=True)
    annotate_all(gm, q, torch.randn(2, 16, 8, requires_grad=True))
    records = [meta.FLOPS.get(n) for n in gm.graph.nodes if meta.FLOPS.get(n).backward]
    assert records and all(r.backward_weight == 0 for r in records)


def test_gpt2_weight_gradients_are_the_linears_and_head(
        hf_gpt2_small: tuple[torch.nn.Module, torch.fx.GraphModule]) -> None:
    """Under torch.export the weights are get_attr inputs of aten ops; W is still found:
    one GEMM per linear per token (2·t·in·out), the LM head included."""
    _, gm = hf_gpt2_small
    weight = sum(meta.FLOPS.get(n).backward_weight for n in gm.graph.nodes)
    d, v, t, n = GPT2["d"], GPT2["v"], GPT2["b"] * GPT2["s"], GPT2["n"]
    expected = n * 2 * t * (3 * d * d + d * d + 4 * d * d + 4 * d * d) + 2 * t * d * v
    assert abs(weight / expected - 1) < 0.01, (weight, expected)


def test_calls_counted_once_give_every_node_its_own_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass counts a repeated call (same function, same argument shapes, dtypes and
    grad flags) once: every node's forward, backward and weight-gradient FLOPs are what
    counting each node on its own gives, on a model of repeated layers traced both ways."""
    from fxpipe.passes import flops

    for name in ("llama", "hf_llama"):
        module = import_example(name)
        model = module.build_model()
        args = module.example_inputs()
        args = args if isinstance(args, tuple) else (args,)
        kwargs = args[0] if len(args) == 1 and isinstance(args[0], dict) else {}
        traced = trace(model, () if kwargs else args, kwargs)
        annotate_flops(traced.gm, *traced.flat_inputs)
        once = {n.name: meta.FLOPS.get(n) for n in traced.gm.graph.nodes}
        assert sum(f.backward > 0 for f in once.values()) > 4, name
        with monkeypatch.context() as patch:
            patch.setattr(flops, "_call", lambda runner, n: None)
            annotate_flops(traced.gm, *traced.flat_inputs)
        each = {n.name: meta.FLOPS.get(n) for n in traced.gm.graph.nodes}
        assert once == each, name


def test_regions_with_the_same_inputs_are_counted_each() -> None:
    """Two grad-mode regions that torch.export records as calls of one function with the
    same tensor: a relu and two matmuls. The second counts its own FLOPs, not the
    first's (the call's body is part of what it is called with)."""

    class TwoRegions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                y = torch.relu(x)
            with torch.no_grad():
                z = x @ x.transpose(-1, -2) @ x
            return self.out(y + z)

    traced = trace(TwoRegions(), (torch.randn(4, 8),))
    assert traced.tracer == "export"
    annotate_flops(traced.gm, *traced.flat_inputs)
    regions = [meta.FLOPS.get(n).forward for n in traced.gm.graph.nodes
               if n.op == "call_function" and "wrap_with_set_grad_enabled" in str(n.target)]
    assert regions == [0, 2 * (4 * 8 * 4) + 2 * (4 * 4 * 8)]


# A mixture of experts as transformers 5.x runs it by default (experts_implementation
# "grouped_mm"): under torch.export in float32 its grouped matmul is a custom op of its own
# (transformers::grouped_mm_fallback), which no FLOP counter knew: the experts cost nothing.
MOE_WIDTH, MOE_FFN, EXPERTS, TOP_K, MOE_BATCH, MOE_SEQ = 32, 64, 4, 2, 2, 8


def _mixtral(device: str | None = None) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=100, hidden_size=MOE_WIDTH, intermediate_size=MOE_FFN,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                           max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return MixtralForCausalLM(config).train()


def test_mixture_of_experts_counts_each_token_through_its_experts() -> None:
    traced = trace(_mixtral(), (), {"input_ids": torch.randint(0, 100, (MOE_BATCH, MOE_SEQ))})
    annotate_flops(traced.gm, *traced.flat_inputs)
    experts = [n for n in traced.gm.graph.nodes if "grouped_mm" in str(n.target)]
    assert experts, "the experts' grouped matmuls are in the graph"
    rows = MOE_BATCH * MOE_SEQ * TOP_K  # every token through its top-k experts
    per_layer = 2 * rows * MOE_WIDTH * 2 * MOE_FFN + 2 * rows * MOE_FFN * MOE_WIDTH  # gate_up, down
    forward = sum(meta.FLOPS.get(n).forward for n in experts)
    backward = sum(meta.FLOPS.get(n).backward for n in experts)
    assert forward == 2 * per_layer
    assert backward == 2 * forward  # the input's and the weight's gradient


@torch.library.custom_op("fxpipe_test::rows_by_offsets", mutates_args=())
def _rows_by_offsets(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x @ weight


@_rows_by_offsets.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _backward_reading_offsets(ctx, grad):  # type: ignore[no-untyped-def]
    x, weight = ctx.saved_tensors
    ctx.offs.tolist()  # as transformers 5.17's grouped-matmul fallback does: no meta data
    return grad @ weight.T, x.T @ grad, None


_rows_by_offsets.register_autograd(_backward_reading_offsets, setup_context=_setup)


class RowsByOffsets(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxpipe_test.rows_by_offsets(x, self.weight, torch.tensor([3, 6]))


def test_a_backward_that_reads_data_is_counted_from_its_formula(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An op whose backward reads tensor data cannot run on meta: on transformers 5.17
    every mixture of experts failed the analysis there. Its backward is counted from the
    forward's shapes."""
    from fxpipe import kernels

    def formula(x_shape, weight_shape, offs_shape):  # type: ignore[no-untyped-def]
        return 4 * x_shape[0] * x_shape[1] * weight_shape[1]

    monkeypatch.setattr(kernels, "backward_flop_formulas",
                        lambda: {torch.ops.fxpipe_test.rows_by_offsets: formula})
    monkeypatch.setattr(kernels, "FLOP_FORMULAS", {
        **kernels.FLOP_FORMULAS,
        torch.ops.fxpipe_test.rows_by_offsets: lambda x, w, *_, **__: 2 * x[0] * x[1] * w[1]})
    traced = trace(RowsByOffsets(), (torch.randn(6, 8),))
    annotate_flops(traced.gm, *traced.flat_inputs)
    (node,) = [n for n in traced.gm.graph.nodes if "rows_by_offsets" in str(n.target)]
    flops = meta.FLOPS.get(node)
    assert (flops.forward, flops.backward, flops.backward_weight) == (384, 768, 768)


def test_grouped_matmul_flops() -> None:
    """torch's own grouped matmul (what a GPU runs): rows grouped, one matrix per group."""
    from torch.utils.flop_counter import FlopCounterMode

    from fxpipe.kernels import flop_formulas

    a = torch.empty(32, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    b = torch.empty(4, 24, 16, device="meta", dtype=torch.bfloat16).transpose(-2, -1)
    offs = torch.tensor([8, 16, 24, 32], device="meta", dtype=torch.int32)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        out = torch._grouped_mm(a, b, offs=offs)
    assert counter.get_total_flops() == 2 * 32 * 16 * 24
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        torch.autograd.grad(out, [a], torch.ones_like(out))
    assert counter.get_total_flops() == 2 * 32 * 16 * 24
