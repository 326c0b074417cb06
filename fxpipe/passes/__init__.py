"""Analysis passes: each takes a GraphModule, fills node.meta records, returns it."""

from __future__ import annotations

from typing import Any

import torch.fx

from fxpipe.kernels import Execution
from fxpipe.passes.base import AnalysisError
from fxpipe.passes.flops import annotate_flops
from fxpipe.passes.memory import annotate_memory
from fxpipe.passes.modules import annotate_modules
from fxpipe.passes.shapes import annotate_shapes

__all__ = [
    "AnalysisError",
    "annotate_all",
    "annotate_flops",
    "annotate_memory",
    "annotate_modules",
    "annotate_shapes",
]


def annotate_all(
    gm: torch.fx.GraphModule, *flat_inputs: Any, execution: Execution | None = None
) -> torch.fx.GraphModule:
    """Shapes, modules, FLOPs and bytes: every record the cost models need, as
    ``execution`` runs the graph (default: a GPU's fused kernels, the model's precision)."""
    # one run of the graph for the three
    annotate_memory(gm, *flat_inputs, execution=execution, shapes=True, flops=True)
    annotate_modules(gm)
    return gm
