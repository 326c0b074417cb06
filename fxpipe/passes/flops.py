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
            result, leaves = self.run_op_detached(n)
        outputs = grad_outputs_of(result)
        backward = 0
        # FlopCounterMode counts matmul, convolution and attention ops; the backward of a
        # node that has none of them in its forward has none either, so it is not run.
        if outputs and leaves and forward.get_total_flops() > 0:
            with FlopCounterMode(display=False, custom_mapping=kernels.FLOP_FORMULAS) as counter:
                torch.autograd.grad(
                    outputs,
                    leaves,
                    grad_outputs=[torch.ones_like(t) for t in outputs],
                    allow_unused=True,
                )
            backward = counter.get_total_flops()
        meta.FLOPS.set(n, meta.FlopInfo(forward.get_total_flops(), backward))
        return result


def annotate_flops(
    gm: torch.fx.GraphModule, *flat_inputs: Any, execution: Execution | None = None
) -> torch.fx.GraphModule:
    """Fill ``meta.FLOPS`` on every node (placeholders and attributes count zero)."""
    _FlopCount(gm, execution).analyze(*flat_inputs)
    return gm
