"""scaled_dot_product_attention as each target runs it: backend, saved bytes, FLOPs.

Legend: b batch, h heads, s sequence length, d head dim. Scores q·kᵀ and the weighted sum
of values cost 2·b·h·s²·d each forward. The math backward does four such matmuls; the
fused kernels' backward recomputes the scores first, five.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.flop_counter as counter
from torch import nn

from fxpipe import kernels as fxpipe_kernels
from fxpipe import meta
from fxpipe.frontend import trace
from fxpipe.kernels import Execution, attention_backend
from fxpipe.passes import annotate_all
from fxpipe.precision import Precision, default_precision, parse_precision

B, H, S, D = 2, 4, 256, 32
MATMUL = 2 * B * H * S * S * D  # FLOPs of one (b·h) × s × s × d matmul


class Attention(nn.Module):
    def __init__(self, causal: bool = True, mask: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.causal = causal
        if mask:
            self.register_buffer("mask", torch.ones(S, S, dtype=torch.bool).tril())
        else:
            self.mask = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, is_causal=self.causal and self.mask is None
        )


def sdpa_node(module: nn.Module, execution: Execution, dtype: torch.dtype = torch.float32):
    traced = trace(module.to(dtype), (torch.randn(B, S, H * D, dtype=dtype),))
    annotate_all(traced.gm, *traced.flat_inputs, execution=execution)
    (node,) = [n for n in traced.gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    return node


@pytest.mark.parametrize("kernels", ["cpu", "cuda"])
def test_fused_attention_flops_count_the_backward_recomputation(kernels: str) -> None:
    flops = meta.FLOPS.get(sdpa_node(Attention(), Execution(kernels)))  # type: ignore[arg-type]
    assert flops.forward == 2 * MATMUL
    assert flops.backward == 5 * MATMUL


class GroupedQuery(nn.Module):
    """Attention with half as many key and value heads as query heads (``enable_gqa``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(H * D, H * D)
        self.kv = nn.Linear(H * D, H * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(B, S, H, D).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, H // 2, D).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _equal_heads_only(count):  # type: ignore[no-untyped-def]
    """torch's FLOP count as torch 2.11 has it: it rejects fewer key heads than query heads."""

    def strict(*shapes):  # type: ignore[no-untyped-def]
        if len({shape[1] for shape in shapes}) > 1:
            raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
        return count(*shapes)

    return strict


@pytest.mark.parametrize("kernels", ["cpu", "cuda"])
def test_grouped_query_attention_flops_on_any_torch(kernels: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key head serves H / H_kv query heads: the work of H heads. On the GPU image's
    torch 2.11 the analysis of any transformers Llama under bf16 failed here."""
    for name in ("sdpa_flop_count", "sdpa_backward_flop_count"):
        strict = _equal_heads_only(getattr(counter, name))
        monkeypatch.setattr(counter, name, strict)
        monkeypatch.setattr(fxpipe_kernels, name, strict)
    node = sdpa_node(GroupedQuery(), Execution(kernels), torch.bfloat16)  # type: ignore[arg-type]
    flops = meta.FLOPS.get(node)
    assert (flops.forward, flops.backward) == (2 * MATMUL, 5 * MATMUL)


def test_math_path_attention_flops() -> None:
    # float64 has no fused GPU kernel: the math path, whose backward does not recompute.
    flops = meta.FLOPS.get(sdpa_node(Attention(), Execution("cuda"), torch.float64))
    assert flops.forward == 2 * MATMUL
    assert flops.backward == 4 * MATMUL


def test_fused_attention_saves_nothing_quadratic() -> None:
    node = sdpa_node(Attention(), Execution("cpu"))
    memory = meta.BYTES.get(node)
    lse = B * H * S * 4
    assert memory.saved_bytes == memory.output_bytes + lse
    math = meta.BYTES.get(sdpa_node(Attention(), Execution("cuda"), torch.float64))
    assert math.saved_bytes >= B * H * S * S * 8  # the scores


def test_cpu_saved_bytes_match_the_real_kernel() -> None:
    """The CPU rule, from the fused op's meta kernel, against autograd on real tensors."""
    module = Attention(mask=True)
    node = sdpa_node(module, Execution("cpu"))
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    inputs = {id(t) for t in (q, k, v)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, attn_mask=module.mask)
    assert meta.BYTES.get(node).saved_bytes == sum(saved.values())


def test_backend_choice() -> None:
    q = torch.empty(B, H, S, D, device="meta")
    bf16 = q.to(torch.bfloat16)
    mask = torch.empty(S, S, dtype=torch.bool, device="meta")
    gpu, volta = Execution("cuda"), Execution("cuda", flash_attention=False)
    assert attention_backend(gpu, bf16, bf16, bf16, None, 0.0, True, False) == "flash"
    assert attention_backend(gpu, q, q, q, None, 0.0, True, False) == "efficient"
    assert attention_backend(gpu, bf16, bf16, bf16, mask, 0.0, False, False) == "efficient"
    assert attention_backend(volta, bf16, bf16, bf16, None, 0.0, True, False) == "efficient"
    f64 = q.to(torch.float64)
    assert attention_backend(gpu, f64, f64, f64, None, 0.0, True, False) == "math"
    assert attention_backend(Execution("cpu"), q, q, q, mask, 0.0, False, False) == "cpu-flash"
    # attention dropout in training: both GPU kernels take it, the CPU's flash kernel not
    assert attention_backend(gpu, bf16, bf16, bf16, None, 0.1, True, False) == "flash"
    assert attention_backend(gpu, q, q, q, None, 0.1, True, False) == "efficient"
    assert attention_backend(Execution("cpu"), q, q, q, None, 0.1, False, False) == "math"
    # a bias that is trained (T5's relative positions): the CPU's flash kernel has no
    # gradient for it, the GPU's memory-efficient kernel has
    bias = torch.zeros(S, S, device="meta", requires_grad=True)
    assert attention_backend(Execution("cpu"), q, q, q, bias, 0.0, False, False) == "math"
    assert attention_backend(gpu, q, q, q, bias, 0.0, False, False) == "efficient"


class TrainedBias(nn.Module):
    """Attention whose additive mask is a parameter, as T5's position bias is."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.bias = nn.Parameter(torch.zeros(1, H, S, S))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


@pytest.mark.parametrize("kernels", ["cpu", "cuda"])
def test_a_trained_bias_is_analysed_as_the_device_runs_it(kernels: str) -> None:
    """The CPU's flash kernel refuses a mask that needs a gradient: the analysis failed
    ("not differentiable with respect to argument 'attn_mask'") on any float32 T5 with
    ``--device cpu``; it now runs the math path, as the CPU does, and keeps the scores."""
    node = sdpa_node(TrainedBias(), Execution(kernels))  # type: ignore[arg-type]
    scores = B * H * S * S * 4
    if kernels == "cpu":
        assert meta.BYTES.get(node).saved_bytes >= scores
    else:
        assert meta.BYTES.get(node).saved_bytes < scores


def test_bf16_mixed_keeps_fp32_parameters_and_bf16_activations() -> None:
    module = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = (torch.randn(8, 64),)
    by_precision = {}
    for precision in (Precision.TRUE_32, Precision.BF16_MIXED, Precision.BF16_TRUE):
        traced = trace(module, x)
        execution = Execution("cpu", precision=precision)
        annotate_all(traced.gm, *traced.flat_inputs, execution=execution)
        nodes = [n for n in traced.gm.graph.nodes if meta.BYTES.has(n)]
        by_precision[precision] = (
            sum(meta.BYTES.get(n).param_bytes for n in nodes),
            sum(meta.BYTES.get(n).saved_bytes for n in nodes),
            meta.SHAPE.get(nodes[-2]).tensors[0].dtype,
        )
    fp32 = by_precision[Precision.TRUE_32]
    mixed = by_precision[Precision.BF16_MIXED]
    bf16 = by_precision[Precision.BF16_TRUE]
    assert mixed[0] == fp32[0] and bf16[0] * 2 == fp32[0]
    assert mixed[2] == bf16[2] == "bfloat16"
    # float32: the ReLU's output (the first Linear's input needs no gradient, so it keeps
    # no weight, and the model input is no activation). Under autocast: that output in
    # bf16, the input cast to bf16 that the first Linear keeps for its weight gradient,
    # and the bf16 copy of the second Linear's weight that its input gradient needs.
    assert fp32[1] == 8 * 64 * 4
    assert mixed[1] == 8 * 64 * 2 + 8 * 64 * 2 + 64 * 64 * 2
    assert bf16[1] * 2 == fp32[1]


def test_precision_names() -> None:
    assert parse_precision("bf16-mixed") is Precision.BF16_MIXED
    with pytest.raises(ValueError, match="32-true, bf16-mixed, bf16-true, 16-mixed"):
        parse_precision("fp8")
    assert default_precision(nn.Linear(2, 2)) is Precision.TRUE_32
    assert default_precision(nn.Linear(2, 2).to(torch.bfloat16)) is Precision.BF16_TRUE


@pytest.mark.parametrize("kernels", ["cpu", "cuda"])
def test_attention_inside_a_module_kept_whole_runs_as_the_target_runs_it(kernels: str) -> None:
    """symbolic_trace keeps torch.nn's MultiheadAttention whole; the attention it calls
    inside (``need_weights=False``) is the target's fused kernel too: nothing quadratic
    saved, and the backward's recomputation counted."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attention(x, x, x, need_weights=False)[0]

    traced = trace(Layer(), (torch.randn(B, S, H * D, requires_grad=True),))
    annotate_all(traced.gm, *traced.flat_inputs, execution=Execution(kernels))  # type: ignore[arg-type]
    (node,) = [n for n in traced.gm.graph.nodes if n.op == "call_module"]
    scores = B * H * S * S * 4
    assert meta.BYTES.get(node).saved_bytes < scores  # q, k, v, out: (b, s, h·d) each
    width, tokens = H * D, B * S
    projections = 2 * tokens * width * 4 * width  # in (3 h·d wide) and out projections
    flops = meta.FLOPS.get(node)
    assert flops.forward == projections + 2 * MATMUL
    # W alone: the projections' weight gradients, the out projection's input gradient on
    # the way to the in projection's, and the attention backward between: five matmuls,
    # the scores recomputed (the math path's backward has four)
    assert flops.backward_weight == projections + 2 * tokens * width * width + 5 * MATMUL
