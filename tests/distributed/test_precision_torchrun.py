"""Transparency across processes at the plan's precision: train_torchrun.py of a
``bf16-mixed`` (or ``16-mixed``) package under a real ``torchrun`` (2 ranks, gloo, CPU)
gives, micro-batch by micro-batch, the output and loss of the unsplit model run under
the same CPU autocast, and its gradients, at that dtype's tolerance; and not those of
the float32 run, so a pipeline that dropped the autocast would fail."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from ._helpers import EXAMPLES, contiguous_plan, load, mini_batch, torchrun
from ._helpers import write_package as write

M = 2
# bfloat16 keeps 8 bits of mantissa: values that went through a few low-precision ops
# agree to about 1%; a gradient is compared against its own largest entry, since
# rounding errors are relative to the sums that made them (as test_precision_runner.py)
RTOL = 2e-2


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * scale,
                               msg=lambda m: f"{what}: {m}")


def _unsplit(model: torch.nn.Module, loss_fn: Any, args: tuple[Any, ...], target: Any,
             dtype: torch.dtype | None, scale: float = 1.0
             ) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """The unsplit model on each of the M micro-batches (under CPU autocast at ``dtype``,
    or in float32 for None): the outputs, the mean loss and its gradients, the backward
    run on the loss times ``scale`` (float16's small gradients underflow without it)."""
    model.zero_grad(set_to_none=True)
    outputs, losses = [], []
    chunks = zip(*(torch.chunk(a, M) for a in args), torch.chunk(target, M), strict=True)
    for *xs, y in chunks:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(*xs)
            loss = loss_fn(out, y)
        (loss * scale / M).backward()
        outputs.append(out.detach())
        losses.append(loss.detach())
    grads = {n: p.grad / scale for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, torch.stack(losses).mean(), grads


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16),
                                                  ("16-mixed", torch.float16)])
def test_torchrun_trains_at_the_plans_precision(tmp_path: Path, precision: str,
                                                 dtype: torch.dtype) -> None:
    model_file = EXAMPLES / "llama.py"
    source, traced = load(str(model_file))
    plan = contiguous_plan(traced.gm.graph, 2, schedule="1f1b", microbatches=M)
    files = write(tmp_path / "pkg", traced, dataclasses.replace(plan, precision=precision))
    assert f'PRECISION = "{precision}"' in files["runner.py"]
    model = source.model
    torch.save(model.state_dict(), tmp_path / "model.pt")
    args, target = mini_batch(source.args), mini_batch(source.target)
    torch.save({"args": args, "kwargs": {}, "target": target}, tmp_path / "batch.pt")
    result = torchrun(2, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model_file),
                      "--checkpoint", str(tmp_path / "model.pt"), "--batch",
                      str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"),
                      "--lr", "0", "--steps", "2")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert "warn" not in result.stderr.lower(), result.stderr[-4000:]
    ranks = [torch.load(tmp_path / "out" / f"rank{rank}.pt") for rank in range(2)]
    assert ranks[0]["loss"] is None
    loss, outputs = ranks[1]["loss"], ranks[1]["outputs"]
    grads = {**ranks[0]["grads"], **ranks[1]["grads"]}

    # GradScaler's initial scale, which two steps without an inf keep
    scale = torch.amp.GradScaler("cpu").get_scale() if precision == "16-mixed" else 1.0
    want_outputs, want_loss, want_grads = _unsplit(model, source.loss_fn, args, target, dtype,
                                                   scale)
    assert len(outputs) == M
    for m, (out, want) in enumerate(zip(outputs, want_outputs, strict=True)):
        assert want.dtype == dtype  # the logits of a matmul under autocast
        _close(out, want, f"micro-batch {m}'s output")
    _close(loss, want_loss, "loss")  # cross_entropy runs in float32 under autocast
    assert sorted(grads) == sorted(want_grads)
    for key, grad in grads.items():
        assert grad.dtype == torch.float32, key  # float32 parameters and gradients
        _close(grad, want_grads[key], key)

    # float32 training gives other numbers: the outputs' dtype shows the autocast ran; the
    # gradients, all together, are nearer the autocast run's than the float32 run's (by a
    # factor that depends on the CPU's float16 kernels, 2-10x on the machines seen: a
    # margin on it would test the machine, so only the order is asserted)
    fp32_outputs, fp32_loss, fp32_grads = _unsplit(model, source.loss_fn, args, target, None)
    assert all(out.dtype != fp32.dtype for out, fp32 in zip(outputs, fp32_outputs, strict=True))
    off = sum(((grads[key] - grad) ** 2).sum().item() for key, grad in fp32_grads.items())
    within = sum(((grads[key] - grad) ** 2).sum().item() for key, grad in want_grads.items())
    assert within < off, (within, off)
    assert loss.item() != fp32_loss.item()


PARAMETER_FREE_MIDDLE = '''
import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.sigmoid(torch.tanh(torch.relu(self.a(x)))))


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    return (torch.ones(2, 8),)


def example_target():
    return torch.zeros(2, 2)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
'''


def test_16_mixed_with_a_parameter_free_stage_stops_every_rank_in_one_line(
        tmp_path: Path) -> None:
    """Every rank steps the GradScaler, whose inf check is a collective: a rank with
    nothing to train would leave the others waiting forever. Each says why instead."""
    model_file = tmp_path / "model.py"
    model_file.write_text(PARAMETER_FREE_MIDDLE)
    _, traced = load(str(model_file))
    plan = contiguous_plan(traced.gm.graph, 3, microbatches=M)  # stage 1: tanh, sigmoid
    files = write(tmp_path / "pkg", traced, dataclasses.replace(plan, precision="16-mixed"))
    assert "bind(" not in files["stage1.py"] and "bind(" in files["stage0.py"]
    result = torchrun(3, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model_file))
    assert result.returncode != 0
    errors = sorted(line for line in result.stderr.splitlines()
                    if line.startswith("train_torchrun: error:"))
    why = ("16-mixed under torchrun steps a GradScaler on every rank, and a stage here has no "
           "parameters to train; use --precision bf16-mixed, or split so that every stage "
           "holds parameters")
    assert errors == [f"train_torchrun: error: rank {rank}: {why}" for rank in range(3)]
