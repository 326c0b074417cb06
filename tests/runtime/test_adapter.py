"""fxpipe.runtime.adapter: a stage as torch.distributed.pipelining wants it."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.runtime import recompute
from fxpipe.runtime.adapter import StageAdapter, check_feed


class Ids(nn.Module):
    INPUTS = ("ids",)
    OUTPUTS = ("h",)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (ids.float(),)


def test_torchrun_takes_the_built_shape_and_refuses_another_in_one_line() -> None:
    adapter = StageAdapter(Ids(), ("ids",), ("h",), {}, lambda values: values["h"])
    adapter.input_shapes = ((2, 32),)  # built with micro-batches of 2 x 32 tokens
    built = adapter.receives, adapter.input_shapes
    check_feed(*built, [torch.zeros(8, 32)], 4)  # 4 micro-batches of that shape
    for other in ((6, 32), (8, 16), (7, 32)):
        with pytest.raises(ValueError, match=rf"'ids' has shape \({other[0]}, {other[1]}\), "
                                             r"but under torchrun the stages were built for 4 "
                                             r"micro-batches of shape \(2, 32\)"):
            check_feed(*built, [torch.zeros(other)], 4)


def test_a_shared_input_is_fed_whole_at_its_built_shape() -> None:
    """Under torchrun a (T, T) mask shared by every sample is one mask, not M of them."""
    built = ("ids", "mask"), ((2, 4), (4, 4))
    check_feed(*built, [torch.zeros(4, 4), torch.zeros(4, 4)], 2, {"mask"})
    with pytest.raises(ValueError, match=r"'mask' has shape \(8, 4\), but under torchrun the "
                                         r"stages were built with it of shape \(4, 4\), handed "
                                         r"whole to every micro-batch"):
        check_feed(*built, [torch.zeros(4, 4), torch.zeros(8, 4)], 2, {"mask"})
    with pytest.raises(ValueError, match=r"'mask' has shape \(4, 4\).*built for 2 micro-batches"):
        check_feed(*built, [torch.zeros(4, 4), torch.zeros(4, 4)], 2)  # not declared shared


class Block(nn.Module):
    """Dropout (random), BatchNorm in training mode (writes its running statistics) and
    an in-place write into a graph input it receives."""

    INPUTS = ("x", "bias")
    OUTPUTS = ("y",)
    WRITES = ("bias",)

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.norm = nn.BatchNorm1d(64)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor]:
        bias.mul_(2)
        h = self.drop(torch.relu(self.norm(self.fc1(x))))
        return (self.fc2(h) * bias,)


class MatmulsRun(TorchDispatchMode):
    """Counts the matrix multiplications that run (``addmm``: each linear's)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.count += func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm)
        return func(*args, **(kwargs or {}))


def _step(recompute: str | bool, matmuls: MatmulsRun | None = None
          ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int, torch.Tensor]:
    """One forward and backward of an adapter around ``Block`` that passes the written
    input on: the gradients, the running mean after it, the bytes autograd saved in the
    forward, and the input as sent on; ``matmuls`` counts the forward matmuls that run."""
    torch.manual_seed(0)
    block = Block()
    adapter = StageAdapter(block, ("x", "bias"), ("y", "bias"), {}, lambda values: None,
                           recompute=recompute)
    x = torch.randn(32, 16, requires_grad=True)
    bias = torch.ones(16)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().nbytes())
        return t

    torch.manual_seed(1)
    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          matmuls or contextlib.nullcontext()):
        y, sent = adapter(x, bias)
    torch.manual_seed(2)  # the run again must not draw new dropout masks
    loss = y.square().sum()
    with matmuls or contextlib.nullcontext():
        loss.backward()
    grads = {name: p.grad for name, p in block.named_parameters()}
    grads["x"] = x.grad
    return grads, block.norm.running_mean.clone(), sum(saved), sent


def test_a_recomputed_stage_keeps_less_and_gives_the_same_gradients_and_buffers() -> None:
    """Under torchrun a stage the plan recomputes runs under non-reentrant checkpoint: the
    same gradients (the same dropout masks, the input it writes in place written once in
    each run), BatchNorm's running statistics updated once, the written input passed on,
    and only its inputs kept for the backward."""
    plain, recomputed = _step(False), _step(True)
    for name, grad in plain[0].items():
        torch.testing.assert_close(recomputed[0][name], grad, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(recomputed[1], plain[1], rtol=0, atol=0)
    torch.testing.assert_close(recomputed[3], plain[3], rtol=0, atol=0)
    assert (plain[3] == 2).all()
    assert recomputed[2] < plain[2] / 4, (recomputed[2], plain[2])


def test_a_selective_stage_runs_its_matmuls_once_and_gives_the_same_gradients() -> None:
    """Recomputed selectively (torch's SAC), a stage keeps its matmuls' outputs: its
    backward runs the other ops again (dropout with the same masks, BatchNorm with its
    running statistics updated once, the written input written once in each run) and
    none of the matmuls, which a stage recomputed in full runs twice. Keeping by a rule
    ("selective:W:N"), it keeps only the matmuls the rule names: fc1 does 2 x 16 FLOPs per
    element into 64 columns, fc2 2 x 64 into 16, so "selective:32:16" keeps fc2's output
    and runs fc1 again, "selective:32:64" keeps both."""
    plain = _step(False)
    modes = ("none", "selective", "full", "selective:32:16", "selective:32:64")
    counts = {mode: MatmulsRun() for mode in modes}
    for mode, matmuls in counts.items():
        grads, running_mean, _, sent = _step(mode, matmuls)
        for name, grad in plain[0].items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=f"{mode} {name}")
        torch.testing.assert_close(running_mean, plain[1], rtol=0, atol=0)
        torch.testing.assert_close(sent, plain[3], rtol=0, atol=0)
    forward = 2  # fc1 and fc2; the backward's matmuls are the same in every mode
    assert counts["full"].count == counts["none"].count + forward
    assert counts["selective"].count == counts["none"].count
    assert counts["selective:32:16"].count == counts["none"].count + 1
    assert counts["selective:32:64"].count == counts["none"].count


class WritesIntoAMatmul(nn.Module):
    INPUTS = ("x",)
    OUTPUTS = ("y",)

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        h = self.fc(x)
        h += 1  # into the matmul's output, which SAC keeps as it is
        return (h.tanh(),)


@pytest.fixture(params=["policy", "mode"])
def watch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Who watches a selective stage's first run for writes into what it keeps: SAC's
    policy, where torch hands it each op's output (torch 2.13), or a dispatch mode of its
    own (an older torch); the number of ops that pass through that mode is counted."""
    if request.param == "policy" and not recompute._POLICY_SEES_OUTPUT:
        pytest.skip(f"torch {torch.__version__}'s SAC policy does not see each op's output")
    monkeypatch.setattr(recompute, "_POLICY_SEES_OUTPUT", request.param == "policy")
    watched = recompute.KeptWrites.__torch_dispatch__
    counted = MODE_CALLS.setdefault(request.param, [])
    counted.clear()

    def counting(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        counted.append(func)
        return watched(self, func, types, args, kwargs)

    monkeypatch.setattr(recompute.KeptWrites, "__torch_dispatch__", counting)
    return str(request.param)


MODE_CALLS: dict[str, list[Any]] = {}


def test_a_selective_stage_dispatches_through_sac_alone_where_its_policy_watches(
        watch: str) -> None:
    """Every op a selective stage's first run dispatches through a Python mode costs the
    host tens of microseconds (bench/sac_overhead.py): where SAC's policy sees each op's
    output, it watches for the writes itself and no second mode runs; else the watch's
    own mode sees every op. The gradients are the same either way."""
    plain, _, _, _ = _step(False)
    grads, _, _, _ = _step("selective")
    for name, grad in plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    if watch == "policy":
        assert MODE_CALLS[watch] == []
    else:
        assert torch.ops.aten.addmm.default in MODE_CALLS[watch], MODE_CALLS[watch]


def test_a_selective_stage_that_writes_into_a_kept_output_is_refused(watch: str) -> None:
    """SAC would hand the backward a matmul's output written after it was kept (torch
    says so only in the backward, in its own words): the forward refuses it and says
    what to do instead. Recomputed in full, or selectively by a rule that does not keep
    that output (the linear does 2 x 16 FLOPs per element into 16 columns: "selective:32:8"
    runs it again, as does "selective:0:0:32x16", which keeps all but those), the stage
    runs and gives the gradient it gives without recompute."""
    grads = []
    for mode in ("none", "full", "selective:32:8", "selective:0:0:32x16"):
        torch.manual_seed(0)
        x = torch.randn(4, 16, requires_grad=True)
        adapter = StageAdapter(WritesIntoAMatmul(), ("x",), ("y",), {}, lambda values: None,
                               recompute=mode)
        adapter(x)[0].sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[2], grads[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[3], grads[0], rtol=0, atol=0)
    adapter = StageAdapter(WritesIntoAMatmul(), ("x",), ("y",), {}, lambda values: None,
                           recompute="selective")
    with pytest.raises(RuntimeError, match=r"aten.add_.Tensor writes in place into the output "
                                           r"of a matmul .* recompute this stage in full, not "
                                           r"at all, or by a rule that does not keep it"):
        adapter(x)
