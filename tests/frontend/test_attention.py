"""Attention as the model calls it eagerly (``fxpipe/tracing/attention.py``): a mask
built from the input sizes alone becomes ``is_causal=True`` where causal and is dropped
where it hides nothing, any other (a sliding window, a shifted diagonal, one read from an
input) is kept; keys and values repeated to the query heads are handed over with
``enable_gqa=True`` in half precision. The graph computes what the model computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.frontend import load_model_file, trace

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attention(nn.Module):
    """One attention layer whose mask ``kind`` is built in forward from the sizes (or read
    from an input: "input"); a branch on a size, so torch.export traces it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 0:
            return x
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        i = torch.arange(s, device=x.device)
        seen = {
            "causal": lambda: i[None, :] <= i[:, None],
            "window": lambda: (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 6),
            "shifted": lambda: i[None, :] <= i[:, None] + 1,
            "full": lambda: torch.ones(s, s, dtype=torch.bool, device=x.device),
            "additive": lambda: torch.zeros(s, s, dtype=x.dtype, device=x.device).masked_fill(
                i[None, :] > i[:, None], float("-inf")),
            "input": lambda: given,
        }[self.kind]()
        mask = seen[None, None].expand(b, 1, s, s) if seen.dim() == 2 else seen
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(h.transpose(1, 2).reshape(b, s, 8))


@pytest.mark.parametrize(("kind", "want"), [
    ("causal", "causal"), ("additive", "causal"), ("full", "full"),
    ("window", None), ("shifted", None), ("input", None),
])
def test_a_mask_of_the_sizes_alone_is_given_back_where_it_is_causal_or_hides_nothing(
    kind: str, want: str | None
) -> None:
    torch.manual_seed(0)
    model = Attention(kind).double()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    given = torch.rand(2, 1, 10, 10) > 0.3
    inputs = (x, given) if kind == "input" else (x,)
    traced = trace(model, inputs, {})
    assert traced.tracer == "export"
    (call,) = [n for n in traced.gm.graph.nodes if n.target is SDPA]
    notes = [n for n in traced.notes if "attention as transformers" in n]
    if want is None:
        assert len(call.args) > 3 and isinstance(call.args[3], torch.fx.Node)
        assert not notes
    else:
        assert len(call.args) == 3 and "attn_mask" not in call.kwargs
        assert call.kwargs["is_causal"] is (want == "causal")
        (note,) = notes
        assert ("1 with a causal mask built from the input sizes alone now is_causal=True"
                if want == "causal" else "hides nothing dropped") in note
    # the graph computes what the model computes, at another length too
    for length in (10, 13):
        x = torch.randn(3, length, 8, dtype=torch.float64, requires_grad=True)
        given = torch.rand(3, 1, length, length) > 0.3
        inputs = (x, given) if kind == "input" else (x,)
        want_out = model(*inputs)
        (want_grad,) = torch.autograd.grad(want_out.sum(), x)
        got_out = traced.gm(*inputs)
        (got_grad,) = torch.autograd.grad(got_out.sum(), x)
        torch.testing.assert_close(got_out, want_out)
        torch.testing.assert_close(got_grad, want_grad)


def test_transformers_causal_mask_becomes_is_causal() -> None:
    """transformers' Llama builds its causal mask under export; every layer's attention
    takes is_causal instead, and the mask's computation is gone from the graph."""
    pytest.importorskip("transformers")
    source = load_model_file(str(EXAMPLES / "hf_llama.py"))
    traced = trace(source.model, source.args, source.kwargs)
    calls = [n for n in traced.gm.graph.nodes if n.target is SDPA]
    assert len(calls) == 2 and all(c.kwargs.get("is_causal") is True for c in calls)
    assert all(len(c.args) == 3 for c in calls)
    assert not [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.le.Tensor]


class Grouped(nn.Module):
    """Attention over 4 query heads and 2 key/value heads, the keys and values repeated to
    the query heads as transformers' repeat_kv does, with a causal mask of the sizes (as
    transformers calls it under export); a branch on a size: export."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k, v = (t.view(b, s, 2, 4).transpose(1, 2) for t in self.kv(x).chunk(2, -1))
        k, v = (t[:, :, None].expand(b, 2, 2, s, 4).reshape(b, 4, s, 4) for t in (k, v))
        i = torch.arange(s, device=x.device)
        mask = (i[None, :] <= i[:, None])[None, None].expand(b, 1, s, s)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return h.transpose(1, 2).reshape(b, s, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_repeated_keys_and_values_are_grouped_heads_in_half_precision(
    dtype: torch.dtype
) -> None:
    """Under bfloat16 autocast the call, its mask given back, takes the unrepeated keys and
    values with enable_gqa=True (FlashAttention's); in float32 the repeat stays (a GPU
    has no fused kernel for grouped heads there). The same attention: the model's result
    to the rounding of its precision."""
    torch.manual_seed(0)
    model, x = Grouped(), torch.randn(2, 6, 16)
    half = dtype != torch.float32
    traced = trace(model, (x,), {}, autocast=dtype if half else None)
    (call,) = [n for n in traced.gm.graph.nodes if n.target is SDPA]
    assert call.kwargs["is_causal"] is True
    assert call.kwargs.get("enable_gqa", False) is half
    assert [a.meta["val"].shape[1] for a in call.args[:3]] == ([4, 2, 2] if half else [4, 4, 4])
    assert bool([n for n in traced.notes if "now enable_gqa=True" in n]) is half
    close = {"rtol": 2e-2, "atol": 2e-2} if half else {}
    for length in (6, 9):
        x = torch.randn(3, length, 16, requires_grad=True)
        with torch.autocast("cpu", dtype, enabled=half):
            want = model(x)
            got = traced.gm(x)
        (want_grad,) = torch.autograd.grad(want.float().sum(), x)
        (got_grad,) = torch.autograd.grad(got.float().sum(), x)
        torch.testing.assert_close(got, want, **close)
        torch.testing.assert_close(got_grad, want_grad, **close)


def test_transformers_attention_under_autocast_is_the_eager_call_bit_for_bit() -> None:
    """transformers' Llama (grouped-query heads) traced under bfloat16 autocast: every
    call is the one it makes eagerly (is_causal, enable_gqa, no mask, no repeat), so the
    graph's outputs and gradients are the model's, bit for bit."""
    pytest.importorskip("transformers")
    source = load_model_file(str(EXAMPLES / "hf_llama.py"))
    model = source.model
    traced = trace(model, source.args, source.kwargs, autocast=torch.bfloat16)
    calls = [n for n in traced.gm.graph.nodes if n.target is SDPA]
    assert calls and all(c.kwargs.get("is_causal") and c.kwargs.get("enable_gqa")
                         for c in calls)
    params = dict(model.named_parameters())
    with torch.autocast("cpu", torch.bfloat16):
        want = model(**source.kwargs).logits
        got = traced.gm(*source.args, **source.kwargs)
    got = got["logits"] if isinstance(got, dict) else got[0] if isinstance(got, tuple) else got
    assert torch.equal(got, want)
    want_grads = torch.autograd.grad(want.float().square().mean(), list(params.values()))
    got_grads = torch.autograd.grad(got.float().square().mean(), list(params.values()))
    for name, a, b in zip(params, got_grads, want_grads, strict=True):
        assert torch.equal(a, b), name


class Unshaped(nn.Module):
    """transformers 4.x's DistilBERT attention: heads split by view and transpose, the
    output put back with ``transpose(1, 2).contiguous().view(...)``; a branch on a size:
    export."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        h = F.scaled_dot_product_attention(q, k, v)
        return self.out(h.transpose(1, 2).contiguous().view(b, s, 16))


def test_a_view_of_attention_output_holds_on_every_kernel() -> None:
    """Export, on the CPU's flash kernel, drops the ``contiguous`` (its output is
    contiguous once transposed); the math kernel's output is not, and the view failed
    there: in the analysis for a GPU in float64 and in a stage run on one. The view is a
    reshape: the graph computes the model on either kernel, and the analysis passes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fxpipe.compiler import analyze
    from fxpipe.cost_models import get_device

    torch.manual_seed(0)
    model = Unshaped().double()
    traced = trace(model, (torch.randn(2, 6, 16, dtype=torch.float64),), {})
    assert traced.tracer == "export"
    assert not [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
        with sdpa_kernel(backend):
            want, got = model(x), traced.gm(x)
        (want_grad,) = torch.autograd.grad(want.sum(), x)
        (got_grad,) = torch.autograd.grad(got.sum(), x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
    analyze(traced, device=get_device("h100"))  # the math kernel there: float64
