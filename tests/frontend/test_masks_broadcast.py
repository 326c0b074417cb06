"""transformers 4.x's attention masks, built with torch.vmap, exported as broadcasts
(fxpipe/tracing/export.py: _masks_broadcast)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from fxpipe import meta
from fxpipe.frontend import trace
from fxpipe.passes import annotate_all
from fxpipe.tracing.export import _broadcast_for_bhqkv

Mask = Callable[..., torch.Tensor]


def vmap_for_bhqkv(mask_function: Mask, bh_indices: bool = True) -> Mask:
    """transformers 4.57's ``masking_utils._vmap_for_bhqkv``."""
    dimensions = [(None, None, None, 0), (None, None, 0, None)]
    if bh_indices:
        dimensions.extend([(None, 0, None, None), (0, None, None, None)])
    for dims in dimensions:
        mask_function = torch.vmap(mask_function, in_dims=dims, out_dims=0)
    return mask_function


PADDING = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
MASKS: dict[str, Mask] = {
    "causal": lambda b, h, q, kv: kv <= q,
    "sliding window": lambda b, h, q, kv: (kv <= q) & (q - kv < 3),
    "padding": lambda b, h, q, kv: torch.ops.aten.index(PADDING, [b, kv]),
    "causal and padding": lambda b, h, q, kv: (kv <= q) & torch.ops.aten.index(PADDING, [b, kv]),
}


@pytest.mark.parametrize("mask", MASKS.values(), ids=list(MASKS))
def test_the_broadcast_is_the_vmapped_mask(mask: Mask) -> None:
    indices = torch.arange(2), torch.arange(1), torch.arange(6), torch.arange(6)
    expected = vmap_for_bhqkv(mask)(*indices)
    assert torch.equal(_broadcast_for_bhqkv(mask)(*indices), expected)
    assert expected.shape == (2, 1, 6, 6)


def test_without_batch_and_head_indices() -> None:
    mask = MASKS["sliding window"]
    q, kv = torch.arange(5), torch.arange(7)
    expected = vmap_for_bhqkv(mask, bh_indices=False)(None, None, q, kv)
    assert torch.equal(_broadcast_for_bhqkv(mask, bh_indices=False)(None, None, q, kv), expected)


class MaskedAttention(nn.Module):
    """Attention whose mask is built as transformers 4.x builds it, by the helper of
    ``transformers.masking_utils`` looked up at call time."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        helper = sys.modules["transformers.masking_utils"]._vmap_for_bhqkv
        mask = helper(MASKS["sliding window"])(torch.arange(b), torch.arange(1),
                                               torch.arange(s), torch.arange(s))
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_vmapped_mask_exports_and_is_analysed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exported as vmap, the mask was functorch batching ops: the analysis failed
    ("Cannot access storage of BatchedTensorImpl") on every transformers 4.57 decoder."""
    monkeypatch.setitem(sys.modules, "transformers.masking_utils",
                        types.SimpleNamespace(_vmap_for_bhqkv=vmap_for_bhqkv))
    model = MaskedAttention()
    x = torch.randn(2, 6, 8)
    traced = trace(model, (x,))
    assert traced.tracer == "export"
    assert not [n for n in traced.gm.graph.nodes if "batch_dim" in str(n.target)]
    annotate_all(traced.gm, *traced.flat_inputs)
    assert all(meta.FLOPS.has(n) for n in traced.gm.graph.nodes)
    (out,) = pytree.tree_leaves(traced.gm(x))
    assert torch.equal(out, model(x))
    assert sys.modules["transformers.masking_utils"]._vmap_for_bhqkv is vmap_for_bhqkv
