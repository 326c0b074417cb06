"""Forward and backward FLOPs of every node, counted by ``torch.utils.flop_counter``.

No hand-written formulas: each op node runs on meta tensors under a
``FlopCounterMode``, then its backward runs alone (``torch.autograd.grad`` of
its outputs with respect to its inputs and parameters that require grad) under
another. Which inputs require grad is what the model says: parameters do, data
inputs do not unless the example input itself requires grad. The fused ops torch's
counter does not know, and the backward of an op that reads tensor data (which meta
tensors do not hold), are counted by the formulas of ``fxpipe.kernels``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from fxpipe import kernels, meta
from fxpipe.kernels import Execution
from fxpipe.passes.base import OP_NODES, MetaInterpreter, grad_outputs_of

__all__ = ["FlopCounter", "annotate_flops"]


class FlopCounter:
    """Counts the FLOPs of op nodes as a ``MetaInterpreter`` reaches them, into
    ``meta.FLOPS``. A function's FLOPs follow from what it is called with: the layers of a
    model repeat the same calls, counted (forward and two backwards) once each."""

    def __init__(self) -> None:
        self.counted: dict[Hashable, meta.FlopInfo] = {}
        # the ops known by the time the pass runs
        self.formulas = kernels.flop_formulas()
        self.backward_formulas = kernels.backward_flop_formulas()

    def count(self, runner: MetaInterpreter, n: torch.fx.Node) -> None:
        """``n``'s FLOPs, its inputs in ``runner``'s environment (before ``n`` runs or
        after: the op is run again on copies of them, under a counter, when not known)."""
        if n.op not in OP_NODES:
            meta.FLOPS.set(n, meta.FlopInfo(0, 0))
            return
        key = _call(runner, n)
        if key is not None and key in self.counted:
            meta.FLOPS.set(n, self.counted[key])
            return
        info = _count(runner, n, self.formulas, self.backward_formulas)
        meta.FLOPS.set(n, info)
        if key is not None:
            self.counted[key] = info


class _FlopCount(MetaInterpreter):
    pass_name = "FLOP counting"

    def __init__(self, gm: torch.fx.GraphModule, execution: Execution | None) -> None:
        super().__init__(gm, execution)
        self.counter = FlopCounter()

    def execute(self, n: torch.fx.Node) -> Any:
        self.counter.count(self, n)
        return super().execute(n)


def _call(runner: MetaInterpreter, n: torch.fx.Node) -> Hashable | None:
    """What the FLOPs of ``n`` depend on: a function or method with its arguments, each
    tensor by shape, dtype, whether it requires grad and whether it is a parameter; None
    for a module call (its state and code are its own)."""
    if n.op == "call_module":
        return None

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.requires_grad,
                    id(value) in runner.state_ids, value.stride())
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, *map(spec, value))
        if isinstance(value, dict):
            return ("dict", *((k, spec(v)) for k, v in value.items()))
        if isinstance(value, torch.nn.Module):  # a region's body: its own code
            return ("module", id(value))
        return ("value", type(value).__name__, repr(value))

    args, kwargs = runner.fetch_args_kwargs_from_env(n)
    return (n.op, n.target, spec(args), spec(kwargs))


def _count(runner: MetaInterpreter, n: torch.fx.Node, formulas: dict[Any, Any],
           backward_formulas: dict[Any, Any]) -> meta.FlopInfo:
    with FlopCounterMode(display=False, custom_mapping=formulas) as forward:
        result, inputs, weights = runner.run_op_split(n)
    outputs = grad_outputs_of(result)
    backward = backward_formulas.get(getattr(n.target, "overloadpacket", n.target))
    if backward is not None:  # both gradients at once, as below: whole in W and the total
        args, _ = runner.fetch_args_kwargs_from_env(n)
        flops = backward(*(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        return meta.FlopInfo(forward.get_total_flops(), flops if inputs or weights else 0,
                             backward_weight=flops if weights else 0)
    # FlopCounterMode counts matmul, convolution and attention ops; the backward of a
    # node that has none of them in its forward has none either, so it is not run.
    # The whole backward and the weight gradient (W) are counted apart, the input
    # gradient (B) being the rest: two backward calls, as a zero-bubble schedule splits
    # them. (An op whose backward makes both gradients at once, transformers' grouped
    # matmul, counts them whole in W and in the total, never twice.)
    if not (outputs and forward.get_total_flops() > 0):
        inputs, weights = [], []
    total = _backward_flops(outputs, inputs + weights, formulas, retain=bool(weights))
    weight_flops = min(_backward_flops(outputs, weights, formulas, retain=False), total)
    return meta.FlopInfo(forward.get_total_flops(), total, backward_weight=weight_flops)


def _backward_flops(outputs: list[torch.Tensor], wrt: list[torch.Tensor],
                    formulas: dict[Any, Any], *, retain: bool) -> int:
    """FLOPs of the gradient of ``outputs`` with respect to ``wrt`` (0 for none)."""
    if not wrt:
        return 0
    with FlopCounterMode(display=False, custom_mapping=formulas) as counter:
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
