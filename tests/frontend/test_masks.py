"""Attention masks built from the input sizes alone (``fxpipe/tracing/masks.py``): a
causal one becomes ``is_causal=True``, one that hides nothing is dropped, and any other
(a sliding window, a shifted diagonal, one read from an input) is kept. The graph
computes what the model computes."""

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
    notes = [n for n in traced.notes if "attention masks" in n]
    if want is None:
        assert len(call.args) > 3 and isinstance(call.args[3], torch.fx.Node)
        assert not notes
    else:
        assert len(call.args) == 3 and "attn_mask" not in call.kwargs
        assert call.kwargs["is_causal"] is (want == "causal")
        (note,) = notes
        assert ("now is_causal=True" if want == "causal" else "now dropped") in note
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
