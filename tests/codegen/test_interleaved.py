"""Transparency of interleaved 1F1B through the generated package: a model cut into
K * v = 4 stage modules for K = 2 GPUs and v = 2 chunks each (GPU 0 runs stages 0 and
2, GPU 1 stages 1 and 3) gives the unsplit model's outputs and gradients."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from fxpipe.codegen import generate
from fxpipe.codegen.stages import PlanError
from fxpipe.frontend import Traced, trace
from fxpipe.plan import Plan
from fxpipe.schedules import interleaved_1f1b

from ._models import grads, import_package, ruff, write_package
from ._plans import contiguous_plan

# K: GPUs, v: virtual stages per GPU, M: micro-batches.
K, V, M = 2, 2, 4
BATCH = 8  # two samples per micro-batch


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(8))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class SkipNet(nn.Module):
    """Skips that cross stages: ``h1`` from stage 0 is read again by the last ops
    (stage 3, the other GPU's second chunk), ``h2`` by the third quarter (stage 2, the
    same GPU's second chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(5, 5) for _ in range(7))
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = torch.relu(self.fc[0](x))
        h2 = torch.sigmoid(self.fc[1](h1))
        h3 = torch.tanh(self.fc[2](h2))
        h4 = torch.tanh(self.fc[3](h3))
        h5 = torch.tanh(self.fc[4](h4)) + h2
        h6 = torch.tanh(self.fc[5](h5))
        h7 = self.fc[6](h6) * h1
        return self.head(h7 + h1)


def _interleaved(model: nn.Module, example: torch.Tensor) -> tuple[Traced, Plan]:
    traced = trace(model, (example,))
    plan = contiguous_plan(traced.gm.graph, K * V, schedule="interleaved", microbatches=M,
                           model=type(model).__name__)
    return traced, dataclasses.replace(plan, virtual_stages=V)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


@pytest.mark.parametrize("make", [MLP, SkipNet])
@pytest.mark.parametrize("devices", [None, ["cpu"] * K, ["cpu"] * (K * V)])
def test_interleaved_runner_matches_the_model(
    tmp_path: Path, make: type[nn.Module], devices: list[str] | None
) -> None:
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(BATCH, model.head.in_features, dtype=torch.float64)
    traced, plan = _interleaved(model, x[:2])
    write_package(tmp_path / "pkg", traced, plan)
    package = import_package(tmp_path / "pkg")
    assert package.DEVICE_OF == (0, 1, 0, 1) and package.runner.NUM_GPUS == K
    assert interleaved_1f1b(K, V, M) == package.SCHEDULE
    if isinstance(model, SkipNet):  # the skips really cross stages
        inputs = [stage.INPUTS for stage in package.build_stages(model)]
        assert "relu" in inputs[3] and "sigmoid" in inputs[2]

    runner = package.PipelineRunner(package.build_stages(model, devices), devices)
    target = torch.randn(BATCH, model.head.out_features, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    loss = runner.step((x,), target, _loss)
    pipeline_grads = grads(model)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        pipeline_out = runner.forward(x)

    want = model(x)
    want_loss = _loss(want, target)
    want_loss.backward()
    model_grads = grads(model)

    torch.testing.assert_close(pipeline_out, want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.as_tensor(loss), want_loss.detach(), rtol=0, atol=1e-12)
    assert sorted(pipeline_grads) == sorted(model_grads)
    for key, value in model_grads.items():
        torch.testing.assert_close(pipeline_grads[key], value, rtol=0, atol=1e-12,
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_devices_one_per_stage_or_one_per_gpu(tmp_path: Path) -> None:
    model = MLP().double()
    traced, plan = _interleaved(model, torch.randn(2, 6, dtype=torch.float64))
    write_package(tmp_path / "pkg", traced, plan)
    package = import_package(tmp_path / "pkg")
    gpus = ["cuda:0", "cuda:1"]
    assert package.stage_devices(gpus) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert package.stage_devices(["a", "b", "c", "d"]) == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="got 3 devices for 4 stages on 2 GPUs"):
        package.build_stages(model, ["cpu"] * 3)
    with pytest.raises(ValueError, match="got 3 devices for 4 stages on 2 GPUs"):
        package.PipelineRunner(package.build_stages(model), ["cpu"] * 3)


def test_interleaved_package_is_ruff_clean_and_byte_identical(tmp_path: Path) -> None:
    model = SkipNet().double()
    example = torch.randn(2, 5, dtype=torch.float64)
    first = generate(*_interleaved(model, example))
    assert first == generate(*_interleaved(model, example))
    header = first["runner.py"]
    assert "DEVICE_OF = (0, 1, 0, 1)\nNUM_GPUS = 2\n" in header
    assert "#     gpu 0 | F0a F1a F0b F1b F2a B0b F3a" in header  # the picture, per GPU
    traced, plan = _interleaved(model, example)
    # a model label as the CLI writes it: the launch script's title wraps under the limit
    write_package(tmp_path / "pkg", traced,
                  dataclasses.replace(plan, model="examples/skip_net.py:build_model"))
    assert ruff(tmp_path / "pkg") == ""


def test_micro_batches_not_a_multiple_of_the_gpus_is_a_plan_error() -> None:
    model = MLP().double()
    traced, plan = _interleaved(model, torch.randn(2, 6, dtype=torch.float64))
    with pytest.raises(PlanError, match=r"micro-batches \(3\) to be a multiple of the GPUs"):
        generate(traced, dataclasses.replace(plan, microbatches=3))
