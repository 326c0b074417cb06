"""Grad-mode and autocast regions inside forward: symbolic_trace does not record them,
so fxpipe notices them while tracing and captures the model with torch.export, which
does (``wrap_with_set_grad_enabled`` / ``wrap_with_autocast``); the stages run exactly
the regions the model runs, and the plan's notes say which tracer was used and why."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from ._compile import compile_package

M = 4


class NoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.last = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        with torch.no_grad():
            g = self.frozen(h)  # no gradient to frozen, none back through g into first
        return self.last(h * g)


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.inside = nn.Linear(8, 8)
        self.last = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            g = self.inside(h)  # bfloat16: differs from float32 by ~1e-3
        return self.last(h + g.float())


class LongNamedNoGrad(nn.Module):
    """A no_grad region reading buffers whose names make its body's ``def`` line wrap."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.register_buffer("a_rather_long_buffer_name_number_one", torch.rand(4))
        self.register_buffer("a_rather_long_buffer_name_number_two", torch.rand(4))
        self.last = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        with torch.no_grad():
            scale = (x * self.a_rather_long_buffer_name_number_one
                     + self.a_rather_long_buffer_name_number_two).sum(-1, keepdim=True)
        return self.last(h * scale)


def test_a_region_whose_signature_wraps_is_written_as_python(tmp_path: Path) -> None:
    """The body's docstring goes after its wrapped ``def`` line, not into its parameters
    (transformers' Speech2Text and Reformer failed to write so)."""
    torch.manual_seed(0)
    model = LongNamedNoGrad().double()
    reference = copy.deepcopy(model)
    x = torch.randn(M * 2, 4, dtype=torch.float64)
    _, package = compile_package(model, (x[:2],), tmp_path / "pkg", gpus=2, microbatches=M)
    assert '    def forward(\n        self,\n' in (tmp_path / "pkg" / "stage0.py").read_text()
    runner = package.PipelineRunner(package.build_stages(model))
    runner.step((x,), None, lambda out, _t: out.pow(2).mean())
    reference(x).pow(2).mean().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference.get_parameter(name).grad,
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_no_grad_region_is_kept(tmp_path: Path, schedule: str) -> None:
    torch.manual_seed(0)
    model = NoGrad().double()
    reference = copy.deepcopy(model)
    x = torch.randn(M * 2, 4, dtype=torch.float64)
    traced, package = compile_package(model, (x[:2],), tmp_path / "pkg", gpus=3,
                                      microbatches=M, schedule=schedule)
    assert traced.tracer == "export"
    assert any("torch.no_grad()" in note for note in package.PLAN["notes"])
    runner = package.PipelineRunner(package.build_stages(model))
    runner.step((x,), None, lambda out, _t: out.pow(2).mean())
    reference(x).pow(2).mean().backward()
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None
    torch.testing.assert_close(model.first.weight.grad, reference.first.weight.grad,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.last.weight.grad, reference.last.weight.grad,
                               rtol=1e-12, atol=1e-12)


def test_autocast_region_is_kept(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Autocast()
    reference = copy.deepcopy(model)
    x = torch.randn(M * 2, 8)
    traced, package = compile_package(model, (x[:2],), tmp_path / "pkg", gpus=2,
                                      microbatches=M)
    assert traced.tracer == "export"
    assert any("torch.autocast()" in note for note in package.PLAN["notes"])
    runner = package.PipelineRunner(package.build_stages(model))
    with torch.no_grad():
        got, want = runner.forward(x), reference(x)
        full_precision = reference.last(torch.tanh(reference.first(x)) * 1
                                        + reference.inside(torch.tanh(reference.first(x))))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (want - full_precision).abs().max() > 1e-4  # the region matters at this size
    runner.step((x,), None, lambda out, _t: out.pow(2).mean())
    # bfloat16 matmuls round per micro-batch: the reference runs micro-batch by micro-batch
    for chunk in x.chunk(M):
        (reference(chunk).pow(2).mean() / M).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
