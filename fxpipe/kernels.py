"""Ops whose meta-device path differs from the kernel the target device runs.

``scaled_dot_product_attention`` on the meta device takes the math path: it materialises
the (heads × seq × seq) scores and softmax, and autograd saves them. A GPU runs a fused
kernel (FlashAttention, memory-efficient) and so does the CPU (its flash kernel): they save
q, k, v, the output and a log-sum-exp per query row, nothing quadratic, and their backward
recomputes the scores. So the analysis calls the fused op the target would pick; its
autograd formula then saves exactly what the device's does (shapes from its meta kernel)
and ``FlopCounterMode`` counts its FLOPs, the backward's recomputation included. Attention
written out by hand (matmul, softmax) is left alone: the device runs it as written.

Which backend, for the call's dtype, shapes and mask:

- ``cpu``: PyTorch is asked (``torch._fused_sdp_choice``) on tiny CPU tensors with the
  call's dtype, batch-free heads and head dims, dropout, causal flag and mask kind (the
  CPU's flash kernel takes no dropout and no mask that needs a gradient: attention
  dropout in training, and a trained bias, run the math path).
- ``cuda`` (no GPU here to ask): PyTorch's order, flash, then memory-efficient, then
  math, under the constraints ``sdp_utils.cpp`` checks that a plan can see (both fused
  kernels take dropout, keeping only its random seed for backward): flash needs
  float16/bfloat16, no explicit mask, equal head dims of at most 256 and a GPU of
  compute capability 8.0 or later (``Execution.flash_attention``); memory-efficient takes
  float32 too and a mask, not grouped-query heads; float64 runs the math path.

A boolean mask is turned into an additive float mask of the query's dtype first, as both
devices do, and the fused kernels keep that copy for backward (an L×L tensor per call).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.backends.cuda import SDPBackend
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from fxpipe.precision import Precision

__all__ = ["FLOP_FORMULAS", "SDPA_TARGETS", "Execution", "attention_backend",
           "backward_flop_formulas", "flop_formulas", "scaled_dot_product_attention"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Execution:
    """How the target runs the graph, where that changes what the analysis must count."""

    kernels: Literal["cuda", "cpu"] = "cuda"  # whose fused kernels (attention) run the ops
    flash_attention: bool = True  # a GPU with FlashAttention kernels (compute capability 8+)
    precision: Precision | None = None  # None: as the model's parameters are


# The call targets of scaled_dot_product_attention in symbolic_trace and torch.export graphs.
SDPA_TARGETS = frozenset(
    {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
)
# torch's own, which the device runs as it picks (the meta device: the math path); bound
# here because the analysis puts this module's function in its place inside a node that
# calls attention itself (fxpipe.metadevice)
_MATH_OR_ANY = F.scaled_dot_product_attention

Backend = Literal["cpu-flash", "flash", "efficient", "math"]


def scaled_dot_product_attention(
    execution: Execution,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as the target's fused kernel runs it."""
    device_type = query.device.type
    # Autocast casts SDPA's inputs; a direct call of the fused op would not (the meta device
    # has no autocast: fxpipe's autocast runs are on fake CPU tensors).
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    backend = attention_backend(execution, query, key, value, attn_mask, dropout_p, is_causal,
                                enable_gqa)
    if backend == "math":
        return _MATH_OR_ANY(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
            attn_mask.logical_not(), float("-inf")
        )
    if backend == "cpu-flash":
        out = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
    elif backend == "flash":
        out = aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
    else:
        needs_lse = any(t.requires_grad for t in (query, key, value))
        out = aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, needs_lse, dropout_p, is_causal, scale=scale
        )
    result: torch.Tensor = out[0]
    return result


def attention_backend(
    execution: Execution,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> Backend:
    """The kernel the target device runs this call with (see the module docstring)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "math"  # the fused kernels take (batch, heads, seq, head_dim) only
    if execution.kernels == "cpu":  # ask PyTorch's CPU dispatcher, on tiny real tensors
        with unset_fake_temporarily():  # real tensors, even inside a fake-tensor analysis run
            choice = torch._fused_sdp_choice(
                _probe(query), _probe(key), _probe(value), _probe_mask(attn_mask), dropout_p,
                is_causal, enable_gqa=enable_gqa,
            )
        return "cpu-flash" if choice == SDPBackend.FLASH_ATTENTION.value else "math"
    dtype = query.dtype
    head_dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    grouped = query.shape[1] != key.shape[1]
    if (execution.flash_attention and dtype in (torch.float16, torch.bfloat16)
            and attn_mask is None and len(head_dims) == 1 and max(head_dims) <= 256):
        return "flash"
    if dtype in (torch.float16, torch.bfloat16, torch.float32) and not grouped:
        return "efficient"
    return "math"


def _probe(t: torch.Tensor) -> torch.Tensor:
    """A tiny zero copy of an attention operand: one sample, at most 4 positions, the same
    heads, head dim, dtype and ``requires_grad`` (what the dispatcher's choice depends on)."""
    *lead, seq, last = t.shape
    shape = [1 if i == 0 else d for i, d in enumerate(lead)] + [min(seq, 4), last]
    return torch.zeros(shape, dtype=t.dtype, requires_grad=t.requires_grad)


def _probe_mask(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A tiny zero copy of an attention mask: at most 4 x 4, the same dtype (its kind),
    rank and ``requires_grad`` (a trained bias, T5's: the CPU's flash kernel takes none),
    a 4-d mask's batch dim cut to one sample."""
    if attn_mask is None:
        return None
    *lead, rows, cols = attn_mask.shape
    shape = [1 if len(lead) == 2 and i == 0 else d for i, d in enumerate(lead)]  # batch
    return torch.zeros([*shape, min(rows, 4), min(cols, 4)], dtype=attn_mask.dtype,
                       requires_grad=attn_mask.requires_grad)


def _as_query_heads(query_shape: Any, shape: Any) -> tuple[int, ...]:
    """A key's or value's shape with the query's heads: grouped-query attention
    (``enable_gqa``) pairs every query head with a key head, so the kernel does the work of
    as many heads as the query has. torch 2.11's counter rejects unequal heads (2.13's
    takes them)."""
    batch, _, seq, dim = shape
    return (batch, query_shape[1], seq, dim)


def _forward_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query_shape, _as_query_heads(query_shape, key_shape),
                               _as_query_heads(query_shape, value_shape)))


def _backward_flops(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any,
                    *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out_shape, query_shape,
                                        _as_query_heads(query_shape, key_shape),
                                        _as_query_heads(query_shape, value_shape)))


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None,
                      **kwargs: Any) -> int:
    """A grouped matmul (mixture-of-experts layers): each group's rows times its matrix.
    2-d by 3-d (rows grouped, one (K, N) matrix per group) and 3-d by 3-d: 2 K per output
    element; 2-d by 2-d (K grouped, the weight gradient): 2 M K N over all groups."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _fallback_backward_flops(input_shape: Any, weight_shape: Any, *args: Any,
                             out_shape: Any = None, **kwargs: Any) -> int:
    """transformers' grouped-matmul fallback backward: the input's and the weight's gradient
    (2 S I O each) in one op, whichever is asked for."""
    return 4 * math.prod(input_shape) * weight_shape[-1]


# FLOP formulas for the fused ops, where torch.utils.flop_counter does not know them or
# (torch 2.11's) rejects grouped-query attention: the CPU flash kernel does the work of
# the GPU ones (its backward recomputes the scores too); grouped matmuls do a mixture of
# experts' expert work, as many rows as tokens times experts per token.
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **dict.fromkeys((aten._scaled_dot_product_flash_attention_for_cpu,
                     aten._scaled_dot_product_flash_attention,
                     aten._scaled_dot_product_efficient_attention,
                     aten._scaled_dot_product_cudnn_attention), _forward_flops),
    **dict.fromkeys((aten._scaled_dot_product_flash_attention_for_cpu_backward,
                     aten._scaled_dot_product_flash_attention_backward,
                     aten._scaled_dot_product_efficient_attention_backward,
                     aten._scaled_dot_product_cudnn_attention_backward), _backward_flops),
    aten._grouped_mm: _grouped_mm_flops,
}
# transformers' own ops, where its grouped matmul cannot run (under torch.export in
# float32, on the meta device): (op name, formula), counted once transformers defines them
_TRANSFORMERS_FORMULAS = (("grouped_mm_fallback", _grouped_mm_flops),
                          ("grouped_mm_fallback_backward", _fallback_backward_flops))


# Ops whose backward FLOPs follow from their forward operands' shapes, counted so instead
# of run: transformers 5.17 runs its grouped-matmul fallback's backward as Python that reads
# the groups' offsets (``offs.tolist()``), which a meta tensor does not hold (later versions
# make that backward an op of its own, counted by the formula above).
_TRANSFORMERS_BACKWARD = (("grouped_mm_fallback", _fallback_backward_flops),)


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """``FLOP_FORMULAS`` and the formulas of the ops transformers has registered so far."""
    return _registered(FLOP_FORMULAS, _TRANSFORMERS_FORMULAS)


def backward_flop_formulas() -> dict[Any, Callable[..., int]]:
    """Op -> its backward's FLOPs from the shapes of its tensor operands (see above), for
    the ops transformers has registered so far."""
    return _registered({}, _TRANSFORMERS_BACKWARD)


def _registered(known: dict[Any, Callable[..., int]],
                transformers_ops: tuple[tuple[str, Callable[..., int]], ...]
                ) -> dict[Any, Callable[..., int]]:
    formulas = dict(known)
    for name, formula in transformers_ops:
        with contextlib.suppress(AttributeError, RuntimeError):
            formulas[getattr(torch.ops.transformers, name)] = formula
    return formulas
