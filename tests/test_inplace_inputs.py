"""In-place ops on model inputs and on values several ops read: every split computes what
the unsplit model computes (transparency, single-process runner), forward and step.

The solver sees only the graph's edges. ``x.mul_(2); x.add_(1); l1(x)`` gives no edge
from the in-place ops to ``l1`` (all three read the placeholder ``x``), so before the
lowering ordered them a cut could run ``l1`` on the unmutated input in stage 0 and the
in-place ops in stage 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fxpipe.codegen import generate, load_package
from fxpipe.compiler import SplitOptions, analyze, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import trace
from fxpipe.lower import lower
from fxpipe.schedules import ScheduleKind

M = 2  # micro-batches


class InPlaceOnInput(nn.Module):
    """The model of the report: in-place ops on the input, then two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 64)
        self.l2 = nn.Linear(64, 64)
        self.l3 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        x.add_(1)
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


class InPlaceOnSharedValue(nn.Module):
    """``h`` is read before (``old``) and after (``new``) it is mutated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 32)
        self.old = nn.Linear(32, 32)
        self.new = nn.Linear(32, 32)
        self.l4 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        before = torch.tanh(self.old(h + 1.0))  # h + 1.0 saves nothing h.mul_ would change
        h.mul_(0.5)
        after = torch.tanh(self.new(h))
        return self.l4(before + after)


def _loss(output: Any, target: Any) -> torch.Tensor:
    del target
    return output.square().mean()


def _split(model: nn.Module, stages: int, directory: Path) -> Any:
    traced = trace(model, (torch.randn(3, 8, dtype=torch.float64),))
    device = get_device("h100")
    analyze(traced, device=device)
    options = SplitOptions(gpus=stages, device=device, memory_limit=float("inf"),
                           microbatches=M, schedule=ScheduleKind.GPIPE, time_limit_s=10)
    plan = plan_split(traced, label="inplace", options=options)
    assert plan.num_stages == stages
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in generate(traced, plan).items():  # runtime/ is a folder of its own
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text, encoding="utf-8")
    return load_package(directory)


def _check(model: nn.Module, package: Any) -> None:
    runner = package.PipelineRunner(package.build_stages(model))
    x = torch.randn(3 * M, 8, dtype=torch.float64)
    with torch.no_grad():
        want = model(x.clone())
        got = runner.forward(x.clone())
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)

    model.zero_grad(set_to_none=True)
    loss = runner.step((x.clone(),), None, _loss)
    got_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want_loss = _loss(model(x.clone()), None)
    want_loss.backward()
    torch.testing.assert_close(torch.as_tensor(loss), want_loss.detach(), rtol=1e-9, atol=1e-10)
    for key, p in model.named_parameters():
        torch.testing.assert_close(got_grads[key], p.grad, rtol=1e-9, atol=1e-10,
                                   msg=lambda m, key=key: f"gradient of {key}: {m}")


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("model_class", [InPlaceOnInput, InPlaceOnSharedValue])
def test_in_place_ops_stay_ordered_with_every_reader(
    tmp_path: Path, model_class: type[nn.Module], stages: int
) -> None:
    torch.manual_seed(0)
    model = model_class().double()
    package = _split(model, stages, tmp_path / "pkg")
    _check(model, package)


def _lowered(model: nn.Module) -> Any:
    device = get_device("h100")
    traced = trace(model.double(), (torch.randn(3, 8, dtype=torch.float64),))
    analyze(traced, device=device)
    return lower(traced.gm, num_stages=2, device=device, memory_limit=float("inf"),
                 schedule=ScheduleKind.GPIPE, microbatches=M).problem


def test_every_reader_of_a_mutated_input_is_fused_with_the_write() -> None:
    # The mutated input does not travel between stages: the runner hands each stage the
    # input as the caller passed it.
    p = _lowered(InPlaceOnInput())
    names = [n.name for n in p.nodes]
    groups = [{names[i] for i in group} for group in p.colocate]
    assert any({"mul_", "add_", "l1"} <= g for g in groups), groups


def test_readers_of_a_mutated_value_are_ordered_around_the_write() -> None:
    p = _lowered(InPlaceOnSharedValue())
    names = [n.name for n in p.nodes]
    order = {(names[e.src], names[e.dst]) for e in p.edges if not e.data}
    assert ("add", "mul_") in order  # h + 1.0 reads h before it is halved
    assert ("mul_", "new") in order  # self.new(h) reads it after
    assert all(e.ordered for e in p.edges)
