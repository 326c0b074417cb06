"""Transparency of the runtime on hand-written stages: a 3-stage MLP with a skip
connection from stage 0 to stage 2, a weight tied between stage 0 and stage 2,
a non-tensor graph input and a pytree value with an int leaf crossing stages,
and a loss that also reads an earlier stage's value."""

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.runtime import PipelineRunner
from fxpipe.schedules import gpipe, one_f_one_b, zb1p

BATCH = 8


class Reference(nn.Module):
    def __init__(self, p_drop: float = 0.0) -> None:
        super().__init__()
        self.w_in = nn.Linear(6, 16)
        self.tied = nn.Parameter(torch.randn(16, 16) / 4)
        self.mid = nn.Linear(16, 16)
        self.drop = nn.Dropout(p_drop)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, scale: int = 2) -> dict[str, torch.Tensor]:
        h0 = torch.tanh(self.w_in(x)) @ self.tied
        h1 = self.drop(torch.tanh(self.mid(h0)) * scale)
        h2 = torch.tanh(h1 @ self.tied.t()) + h0 * 0.5 * scale
        return {"logits": self.head(h2), "hidden": h1}


class Stage0(nn.Module):
    INPUTS = ("x", "scale")
    OUTPUTS = ("h0", "skip")

    def __init__(self, model: Reference) -> None:
        super().__init__()
        self.w_in = model.w_in
        self.tied = model.tied

    def forward(self, x: torch.Tensor, scale: int) -> tuple[Any, ...]:
        h0 = torch.tanh(self.w_in(x)) @ self.tied
        return h0, (h0 * 0.5, scale)  # a pytree with an int leaf, read by stage 2


class Stage1(nn.Module):
    INPUTS = ("h0", "scale")
    OUTPUTS = ("h1",)

    def __init__(self, model: Reference) -> None:
        super().__init__()
        self.mid = model.mid
        self.drop = model.drop

    def forward(self, h0: torch.Tensor, scale: int) -> tuple[torch.Tensor]:
        return (self.drop(torch.tanh(self.mid(h0)) * scale),)


class Stage2(nn.Module):
    INPUTS = ("h1", "skip")
    OUTPUTS = ("logits",)

    def __init__(self, model: Reference) -> None:
        super().__init__()
        self.tied = model.tied
        self.head = model.head

    def forward(self, h1: torch.Tensor, skip: tuple[torch.Tensor, int]) -> tuple[torch.Tensor]:
        half_h0, scale = skip
        return (self.head(torch.tanh(h1 @ self.tied.t()) + half_h0 * scale),)


def flatten_inputs(x: torch.Tensor, scale: int = 2) -> dict[str, Any]:
    return {"x": x, "scale": scale}


def build_output(values: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"logits": values["logits"], "hidden": values["h1"]}


def loss_fn(output: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output["logits"], target) + 0.1 * output["hidden"].pow(2).mean()


def make(dtype: torch.dtype, p_drop: float = 0.0) -> tuple[Reference, list[nn.Module]]:
    torch.manual_seed(0)
    model = Reference(p_drop).to(dtype)
    return model, [Stage0(model), Stage1(model), Stage2(model)]


def data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 6, generator=g, dtype=dtype),
            torch.randn(BATCH, 3, generator=g, dtype=dtype))


def runner(stages: list[nn.Module], schedule_fn: Any, m: int, recompute: str | bool = False,
           devices: Any = None) -> PipelineRunner:
    return PipelineRunner(
        stages, devices, schedule=schedule_fn(len(stages), m), microbatches=m,
        flatten_inputs=flatten_inputs, build_output=build_output,
        recompute=[recompute] * len(stages),
    )


def reference_grads(model: Reference, x: torch.Tensor, y: torch.Tensor,
                    scale: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x, scale), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


TOL = {torch.float64: {"rtol": 1e-12, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_forward_equals_unsplit(dtype: torch.dtype, m: int) -> None:
    model, stages = make(dtype)
    x, _ = data(dtype)
    out = runner(stages, one_f_one_b, m).forward(x, scale=3)
    with torch.no_grad():
        ref = model(x, 3)
    assert out.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(out[key], ref[key], **TOL[dtype])
        assert not out[key].requires_grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("schedule_fn", [gpipe, one_f_one_b])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("recompute", [False, True, "selective"])
def test_step_equals_unsplit(dtype: torch.dtype, schedule_fn: Any, m: int,
                             recompute: str | bool) -> None:
    model, stages = make(dtype)
    x, y = data(dtype)
    ref_loss, ref_grads = reference_grads(model, x, y, 2)

    loss = runner(stages, schedule_fn, m, recompute).step((x,), y, loss_fn)

    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss, **TOL[dtype])
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_grads[name], **TOL[dtype], msg=name)


def test_step_takes_keyword_inputs_and_accumulates() -> None:
    model, stages = make(torch.float64)
    x, y = data(torch.float64)
    _, ref_grads = reference_grads(model, x, y, 5)
    pipe = runner(stages, one_f_one_b, 2)
    pipe.step({"x": x, "scale": 5}, y, loss_fn)
    pipe.step({"x": x, "scale": 5}, y, loss_fn)  # like loss.backward() twice
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * ref_grads[name], rtol=1e-12, atol=1e-12)


def test_mixed_recompute_with_dropout_replays_the_same_masks() -> None:
    """Stage 1 (with dropout) recomputed vs. kept: the same seed gives the same grads."""
    x, y = data(torch.float64)
    results = []
    for recompute in ([False, False, False], [True, True, False], [False, True, True],
                      ["selective", "selective", "full"], ["none", "selective", "none"]):
        model, stages = make(torch.float64, p_drop=0.5)
        pipe = PipelineRunner(stages, schedule=gpipe(3, 4), microbatches=4,
                              flatten_inputs=flatten_inputs, build_output=build_output,
                              recompute=recompute)
        torch.manual_seed(123)
        loss = pipe.step((x,), y, loss_fn)
        results.append((loss, [p.grad for p in model.parameters()]))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-12, atol=1e-12)
        for g, g0 in zip(grads, results[0][1], strict=True):
            torch.testing.assert_close(g, g0, rtol=1e-12, atol=1e-12)


def test_single_stage_is_gradient_accumulation() -> None:
    class Whole(nn.Module):
        INPUTS = ("x", "scale")
        OUTPUTS = ("logits", "h1")

        def __init__(self, model: Reference) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor, scale: int) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.model(x, scale)
            return out["logits"], out["hidden"]

    model, _ = make(torch.float64)
    x, y = data(torch.float64)
    ref_loss, ref_grads = reference_grads(model, x, y, 2)
    loss = runner([Whole(model)], one_f_one_b, 4).step((x,), y, loss_fn)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-12, atol=1e-12)


def test_user_errors() -> None:
    _, stages = make(torch.float64)
    x, y = data(torch.float64)
    with pytest.raises(ValueError, match="2 devices for 3 stages"):
        runner(stages, gpipe, 2, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="before"):
        PipelineRunner(stages, schedule=[((1, "F", 0),), ((0, "F", 0),)], microbatches=1,
                       flatten_inputs=flatten_inputs, build_output=build_output)
    with pytest.raises(ValueError, match="want F and B, or F, I and W"):
        PipelineRunner(stages, schedule=gpipe(3, 1), microbatches=2,
                       flatten_inputs=flatten_inputs, build_output=build_output)
    with pytest.raises(ValueError, match="earlier stages"):
        runner([stages[2], stages[1], stages[0]], gpipe, 1)
    with pytest.raises(ValueError, match="I and W actions runs each stage's backward in two "
                                         "passes, which selective recompute cannot"):
        PipelineRunner(stages, schedule=zb1p(3, 3), microbatches=3,
                       recompute=["none", "selective:8:8", "full"],
                       flatten_inputs=flatten_inputs, build_output=build_output)
    with pytest.raises(ValueError, match=r"target's rows along dim 0 \(target: 3\) differ "
                                         r"from the inputs' \(x: 8\)"):
        runner(stages, gpipe, 4).step((x,), y[:3], loss_fn)


# A mini-batch that is not a multiple of M (the last batch of an epoch) is split as
# evenly as torch.tensor_split does, one smaller than M runs as that many micro-batches;
# each micro-batch's loss weighs by its share of the samples, so both stay transparent.
@pytest.mark.parametrize("schedule_fn", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("m", "rows"), [(3, 8), (4, 5), (4, 3), (16, 8), (2, 1)])
@pytest.mark.parametrize("recompute", [False, True])
def test_uneven_and_small_batches_equal_unsplit(schedule_fn: Any, m: int, rows: int,
                                                recompute: bool) -> None:
    model, stages = make(torch.float64)
    x, y = data(torch.float64)
    x, y = x[:rows], y[:rows]
    ref_loss, ref_grads = reference_grads(model, x, y, 2)
    pipe = runner(stages, schedule_fn, m, recompute)

    loss = pipe.step((x,), y, loss_fn)

    torch.testing.assert_close(loss, ref_loss, **TOL[torch.float64])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], **TOL[torch.float64])
    with torch.no_grad():
        ref = model(x, 2)
    out = pipe.forward(x)
    for key in ref:
        torch.testing.assert_close(out[key], ref[key], **TOL[torch.float64])


def test_explicit_cpu_devices_run_the_same() -> None:
    model, stages = make(torch.float64)
    x, y = data(torch.float64)
    ref_loss, ref_grads = reference_grads(model, x, y, 2)
    loss = runner(stages, one_f_one_b, 4, devices=["cpu"] * 3).step((x,), y, loss_fn)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("schedule_fn", [gpipe, one_f_one_b])
@pytest.mark.parametrize("recompute", [False, True])
def test_cuda_streams_equal_cpu(schedule_fn: Any, recompute: bool) -> None:
    """Every stage on cuda:0 with its own stream: outputs and grads equal the CPU run."""
    dtype = torch.float64
    x, y = data(dtype)
    model, stages = make(dtype)
    cpu_out = runner(stages, schedule_fn, 4).forward(x)
    cpu_loss = runner(stages, schedule_fn, 4, recompute).step((x,), y, loss_fn)
    cpu_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model, stages = make(dtype)
    model.cuda()
    dev = [torch.device("cuda", 0)] * 3
    pipe = runner(stages, schedule_fn, 4, recompute, devices=dev)
    assert len({s.cuda_stream for s in pipe.streams.compute}) == 3
    out = pipe.forward(x.cuda())
    loss = pipe.step((x.cuda(),), y.cuda(), loss_fn)
    torch.cuda.synchronize()
    for key in cpu_out:
        torch.testing.assert_close(out[key].cpu(), cpu_out[key], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=1e-10, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), cpu_grads[name], rtol=1e-10, atol=1e-12)


def test_runtime_runs_as_a_copied_package_without_fxpipe(tmp_path: Any) -> None:
    """A generated package carries fxpipe/runtime as a copy: that copy must import and
    run on its own, with nothing of fxpipe importable."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import fxpipe.runtime

    shutil.copytree(Path(fxpipe.runtime.__file__).parent, tmp_path / "copied_runtime",
                    ignore=shutil.ignore_patterns("__pycache__"))
    script = f"""
import sys
sys.path = [p for p in sys.path if p not in ("", {str(Path.cwd())!r})]
sys.path.insert(0, {str(tmp_path)!r})
import torch
import copied_runtime
import copied_runtime.launch  # the torchrun modules too
from copied_runtime.schedule import check_schedule

SCHEDULE = [((0, "F", 0),), ((1, "F", 0),), ((1, "B", 0),), ((0, "B", 0),)]
check_schedule(SCHEDULE, 2, 1)

class Double(torch.nn.Module):
    INPUTS, OUTPUTS = ("x",), ("y",)
    def forward(self, x):
        return (x * 2,)

class Sum(torch.nn.Module):
    INPUTS, OUTPUTS = ("y",), ("z",)
    def forward(self, y):
        return (y.sum(1),)

runner = copied_runtime.PipelineRunner(
    [Double(), Sum()], schedule=SCHEDULE, microbatches=1,
    flatten_inputs=lambda x: {{"x": x}}, build_output=lambda values: values["z"],
)
out = runner.forward(torch.ones(2, 3))
assert out.tolist() == [6.0, 6.0], out
assert not [m for m in sys.modules if m.split(".")[0] == "fxpipe"]
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
