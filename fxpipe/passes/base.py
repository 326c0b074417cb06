"""What every analysis pass shares: an Interpreter that runs the graph on meta tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fxpipe.metadevice import OP_NODES, MetaRunner, copied_from, fresh_like

__all__ = ["OP_NODES", "AnalysisError", "MetaInterpreter", "copied_from", "fresh_like"]


class AnalysisError(RuntimeError):
    """A pass failed at one node; the message names the node."""


class MetaInterpreter(MetaRunner):
    """Runs a graph on meta tensors with the module's state swapped for meta copies.

    Subclasses override ``visit(node, result)`` to record what a node produced, or
    ``execute(node)`` to change how a node runs. Errors name the node.
    """

    pass_name = "analysis"

    def analyze(self, *flat_inputs: Any) -> None:
        self.run_on_meta(*flat_inputs)

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            result = self.execute(n)
            self.visit(n, result)
        except AnalysisError:
            raise
        except Exception as exc:
            raise AnalysisError(
                f"{self.pass_name} failed at {n.format_node()}: {type(exc).__name__}: {exc}"
            ) from exc
        return result

    def execute(self, n: torch.fx.Node) -> Any:
        return super().run_node(n)

    def visit(self, node: torch.fx.Node, result: Any) -> None:
        """Record something about ``node`` given its (meta) result."""

    def run_op_detached(self, n: torch.fx.Node) -> tuple[Any, list[torch.Tensor]]:
        """Run one op node on fresh leaf copies of its tensor inputs.

        Returns the op's result and the leaves that require grad (its inputs and, for
        ``call_module``, the module's parameters), so a caller can run this node's
        backward alone with ``torch.autograd.grad``.
        """
        result, inputs, weights = self.run_op_split(n)
        return result, inputs + weights

    def run_op_split(
        self, n: torch.fx.Node
    ) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
        """``run_op_detached`` with the leaves in two lists: the activations it reads
        (their gradient is the input gradient, B) and the parameters it reads, as a
        ``get_attr`` input or its module's own (their gradient is W)."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []

        def leaf(t: torch.Tensor) -> torch.Tensor:
            if not t.requires_grad:
                return t.detach()
            fresh = t.detach().requires_grad_()
            (weights if id(t) in self.state_ids else inputs).append(fresh)
            # A non-leaf copy of the leaf, so in-place ops inside the node stay legal (a
            # view of it would not be: autograd rejects in-place ops on views of leaves).
            return fresh.clone()

        args, kwargs = pytree.tree_map_only(torch.Tensor, leaf, (args, kwargs))
        if n.op == "call_module":
            submodule = self.fetch_attr(str(n.target))
            weights += [p for p in submodule.parameters() if p.requires_grad]
        result = getattr(self, n.op)(n.target, args, kwargs)
        return result, inputs, weights


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def grad_outputs_of(result: Any) -> list[torch.Tensor]:
    """The result's tensors that carry gradient (the ones a backward starts from)."""
    return [t for t in tensor_leaves(result) if t.requires_grad]
