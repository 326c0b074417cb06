"""Forward and backward FLOPs of every node, counted by ``torch.utils.flop_counter``.

No hand-written formulas: each op node runs on meta tensors under a
``FlopCounterMode``, then its backward runs alone (``torch.autograd.grad`` of
its outputs with respect to its inputs and parameters that require grad) under
another. Which inputs require grad is what the model says: parameters do, data
inputs do not unless the example input itself requires grad.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from fxpipe import kernels, meta
from fxpipe.kernels import Execution
from fxpipe.passes.base import OP_NODES, MetaInterpreter, grad_outputs_of

__all__ = ["annotate_flops"]


class _FlopCount(MetaInterpreter):
    pass_name = "FLOP counting"

    def execute(self, n: torch.fx.Node) -> Any:
        if n.op not in OP_NODES:
            meta.FLOPS.set(n, meta.FlopInfo(0, 0))
            return super().execute(n)
        with FlopCounterMode(display=False, custom_mapping=kernels.FLOP_FORMULAS) as forward:
            result, inputs, weights = self.run_op_split(n)
        outputs = grad_outputs_of(result)
        # FlopCounterMode counts matmul, convolution and attention ops; the backward of a
        # node that has none of them in its forward has none either, so it is not run.
        # The input gradient (B) and the weight gradient (W) are counted apart: two
        # backward calls, one with respect to each set of leaves, as a zero-bubble
        # schedule runs them.
        if not (outputs and forward.get_total_flops() > 0):
            inputs, weights = [], []
        input_flops = _backward_flops(outputs, inputs, retain=bool(weights))
        weight_flops = _backward_flops(outputs, weights, retain=False)
        meta.FLOPS.set(n, meta.FlopInfo(forward.get_total_flops(), input_flops + weight_flops,
                                        backward_weight=weight_flops))
        return result


def _backward_flops(outputs: list[torch.Tensor], wrt: list[torch.Tensor], *,
                    retain: bool) -> int:
    """FLOPs of the gradient of ``outputs`` with respect to ``wrt`` (0 for none)."""
    if not wrt:
        return 0
    with FlopCounterMode(display=False, custom_mapping=kernels.FLOP_FORMULAS) as counter:
        torch.autograd.grad(
            outputs,
            wrt,
            grad_outputs=[torch.ones_like(t) for t in outputs],
            allow_unused=True,
            retain_graph=retain,
        )
    return int(counter.get_total_flops())


def annotate_flops(
    gm: torch.fx.GraphModule, *flat_inputs: Any, execution: Execution | None = None
) -> torch.fx.GraphModule:
    """Fill ``meta.FLOPS`` on every node (placeholders and attributes count zero)."""
    _FlopCount(gm, execution).analyze(*flat_inputs)
    return gm
