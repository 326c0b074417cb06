"""BatchNorm in training mode through a generated pipeline: batch statistics are per
micro-batch (as in GPipe), so the reference is the unsplit model run micro-batch by
micro-batch. Outputs, gradients, running_mean/var and num_batches_tracked must match,
with and without recompute: a recomputed forward must not update the running statistics
a second time."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from ._compile import compile_package

M, BATCH = 4, 3  # micro-batches, samples per micro-batch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.bn1 = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 8)
        self.bn2 = nn.BatchNorm1d(8, momentum=0.3)
        self.fc3 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.fc1(x)))
        h = torch.tanh(self.bn2(self.fc2(h)))
        return self.fc3(h)


class CountingBatchNorm(nn.BatchNorm1d):
    """BatchNorm whose forward is written out in Python, as timm's BatchNormAct2d is: it
    counts batches with ``self.num_batches_tracked.add_(1)``, an op on a buffer that
    symbolic_trace would run once while tracing instead of recording."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.num_batches_tracked.add_(1)
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                        self.bias, self.training, self.momentum or 0.0,
                                        self.eps)


class CountingNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.bn1 = CountingBatchNorm(8)
        self.bn2 = CountingBatchNorm(8, momentum=0.3)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in model.named_buffers()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("net", [Net, CountingNet])
def test_batchnorm_equals_the_model_run_micro_batch_by_micro_batch(
        tmp_path: Path, schedule: str, recompute: str, net: type[Net]) -> None:
    torch.manual_seed(0)
    model = net().double()
    x = torch.randn(M * BATCH, 5, dtype=torch.float64)
    y = torch.randn(M * BATCH, 2, dtype=torch.float64)
    reference = copy.deepcopy(model)
    traced, package = compile_package(model, (x[:BATCH],), tmp_path / "pkg", gpus=2,
                                      microbatches=M, schedule=schedule, recompute=recompute)
    # tracing leaves the model as it was; a count in Python is captured by torch.export
    _assert_same(_buffers(model), _buffers(reference))
    if net is CountingNet:
        assert traced.tracer == "export"
        assert "num_batches_tracked in place" in str(traced.fallback_reason)
    assert any("bn1, bn2" in note and "per micro-batch" in note
               for note in package.PLAN["notes"]), package.PLAN["notes"]
    assert package.PLAN["stages"][0]["recompute"] == recompute  # the plan's word is the policy's
    runner = package.PipelineRunner(package.build_stages(model))

    # Inference in training mode: per-micro-batch statistics, running stats updated M times.
    with torch.no_grad():
        got = runner.forward(x)
        want = torch.cat([reference(chunk) for chunk in x.chunk(M)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _assert_same(_buffers(model), _buffers(reference))

    # One training step: gradients of the mean loss, running stats updated M more times.
    loss = runner.step((x,), y, loss_fn)
    want_loss = sum(loss_fn(reference(xc), yc) for xc, yc in zip(x.chunk(M), y.chunk(M),
                                                                   strict=True)) / M
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-12, atol=1e-12)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(),
                                 strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    _assert_same(_buffers(model), _buffers(reference))
    assert int(model.bn1.num_batches_tracked) == 2 * M
