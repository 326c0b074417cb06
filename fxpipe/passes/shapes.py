"""Shapes and dtypes of every value, propagated on meta tensors (no storage needed)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from fxpipe import meta
from fxpipe.kernels import Execution
from fxpipe.passes.base import MetaInterpreter, tensor_leaves

__all__ = ["annotate_shapes", "value_info"]


def value_info(value: Any) -> meta.ValueInfo:
    """Shape, dtype and size of every tensor leaf of ``value``."""
    return meta.ValueInfo(
        tuple(
            meta.TensorSpec(
                shape=tuple(int(d) for d in t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                nbytes=t.numel() * t.element_size(),
                requires_grad=t.requires_grad,
            )
            for t in tensor_leaves(value)
        ),
        single=isinstance(value, torch.Tensor),
    )


class _ShapeProp(MetaInterpreter):
    pass_name = "shape propagation"

    def visit(self, node: torch.fx.Node, result: Any) -> None:
        meta.SHAPE.set(node, value_info(result))


def annotate_shapes(
    gm: torch.fx.GraphModule, *flat_inputs: Any, execution: Execution | None = None
) -> torch.fx.GraphModule:
    """Fill ``meta.SHAPE`` on every node by running ``gm`` once on meta tensors."""
    _ShapeProp(gm, execution).analyze(*flat_inputs)
    return gm
