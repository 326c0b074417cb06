"""Children, parameters and buffers whose names are not Python identifiers (a keyword
such as ``class``, a dash, a leading digit, a quote): torch.fx printed ``self.d.class``,
a SyntaxError inside both tracers; the stages must read each by a name Python takes and
train as the model does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fxpipe.frontend import trace

from ._models import assert_runner_matches, import_package, ruff, write_package
from ._plans import contiguous_plan

ODD = ("class", "a-b", "0x", 'say "hi"', "lambda")


class OddNames(nn.Module):
    """A ModuleDict keyed by odd names, a child named ``lambda``, a ParameterDict key
    ``in`` and a buffer ``def``; ``branch``: a branch on a size, which only torch.export
    traces."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.branch = branch
        self.d = nn.ModuleDict({name: nn.Linear(6, 6) for name in ODD})
        self.add_module("lambda", nn.Linear(6, 6))
        self.p = nn.ParameterDict({"in": nn.Parameter(torch.randn(6))})
        self.register_buffer("def", torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch and x.shape[0] == 0:
            return x
        for name in ODD:
            x = torch.tanh(self.d[name](x)) + self.p["in"]
        return getattr(self, "lambda")(x) * getattr(self, "def")


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_odd_names_build_and_train_transparently(tmp_path: Path, tracer: str) -> None:
    torch.manual_seed(0)
    model = OddNames(branch=tracer == "export").double()
    x = torch.randn(4, 6, dtype=torch.float64)
    traced = trace(model, (x,))
    assert traced.tracer == tracer
    plan = contiguous_plan(traced.gm.graph, 3, schedule="1f1b", microbatches=2)
    files = write_package(tmp_path / "pkg", traced, plan)
    text = "".join(v for name, v in files.items() if name.startswith("stage"))
    assert 'self.d["class"]' in text  # read by key, not as self.d.class
    assert ruff(tmp_path / "pkg") == ""
    package = import_package(tmp_path / "pkg")
    runner = package.PipelineRunner(package.build_stages(model))

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).pow(2).mean()

    assert_runner_matches(runner, model, (x,), {}, torch.randn(4, 6, dtype=torch.float64),
                          loss_fn)
