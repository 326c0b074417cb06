"""Weight stashing (PipeDream's asynchronous 1F1B) against the update rule written
out on the unsplit model.

# K: stages, M: micro-batches, k: a stage, m: a micro-batch, lr: the SGD step size.

The rule: stage k updates its weights after every backward B(k, m); version v of
stage k is its weights after v updates. Micro-batch m runs forward and backward
on stage k with version c(k, m) = the number of backwards stage k ran before
F(k, m) (read off the schedule table), and

    version i + 1 of stage k = version i - lr * (gradient of micro-batch i's loss
                               w.r.t. stage k's weights, every stage j at c(j, i)).

The reference computes exactly that with ``torch.func.functional_call`` on the
unsplit model, mixing the stages' versions by parameter name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.stashing import WeightStashes
from fxpipe.schedules import gpipe, one_f_one_b

from . import test_runtime
from ._parts import Chain, Part, chain_stages, flatten_x, generated_package, output_of

LR = 0.1
TOL = {"rtol": 1e-12, "atol": 1e-12}
Weights = dict[str, torch.Tensor]


def versions_used(schedule: Sequence[Sequence[tuple[int, str, int]]], num_stages: int,
                  num_mb: int) -> list[list[int]]:
    """c[k][m]: how many backwards stage k ran before F(k, m). Also checks that each
    stage runs its backwards in micro-batch order, so B(k, i) makes version i + 1."""
    c = [[-1] * num_mb for _ in range(num_stages)]
    backwards: list[list[int]] = [[] for _ in range(num_stages)]
    for tick in schedule:
        for k, kind, m in tick:  # a tick holds one action per stage at most
            if kind == "F":
                c[k][m] = len(backwards[k])
            else:
                backwards[k].append(m)
    assert backwards == [list(range(num_mb))] * num_stages
    return c


def owners(model: nn.Module, stages: list[nn.Module]) -> list[list[str]]:
    """owners[k]: the model's names of the parameters bound into stage k."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of[id(p)] for p in stage.parameters()] for stage in stages]


def stashed_sgd(model: nn.Module, owned: list[list[str]], xs: Sequence[torch.Tensor],
                ys: Sequence[torch.Tensor], c: list[list[int]]) -> tuple[Weights, torch.Tensor]:
    """The rule above with plain SGD: the final weights by name and the mean loss."""
    num_stages, num_mb = len(owned), len(xs)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    # versions[k][v]: stage k's weights after v updates
    versions = [[{n: start[n] for n in owned[k]}] for k in range(num_stages)]
    losses = []
    for m in range(num_mb):
        params = {n: w.clone().requires_grad_()
                  for k in range(num_stages) for n, w in versions[k][c[k][m]].items()}
        loss = F.mse_loss(torch.func.functional_call(model, params, (xs[m],)), ys[m])
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        for k in range(num_stages):
            versions[k].append({n: w - LR * grads[n] for n, w in versions[k][m].items()})
        losses.append(loss.detach())
    final = {n: w for k in range(num_stages) for n, w in versions[k][num_mb].items()}
    return final, torch.stack(losses).mean()


def setup(num_stages: int, batch: int) -> tuple[Chain, list[nn.Module], torch.Tensor,
                                                 torch.Tensor]:
    torch.manual_seed(0)
    model = Chain(num_stages).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 6, generator=g, dtype=torch.float64)
    y = torch.randn(batch, 2, generator=g, dtype=torch.float64)
    return model, chain_stages(model), x, y


def run(stages: list[nn.Module], schedule: Any, m: int, x: torch.Tensor, y: torch.Tensor,
        **options: Any) -> torch.Tensor:
    runner = PipelineRunner(stages, schedule=schedule, microbatches=m, flatten_inputs=flatten_x,
                            build_output=output_of("y"), weight_stashing=True, **options)
    optimizers = [torch.optim.SGD(stage.parameters(), lr=LR) for stage in stages]
    return runner.step((x,), y, F.mse_loss, optimizers=optimizers)


def assert_weights(model: nn.Module, want: Weights) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], **TOL, msg=lambda s, n=name: f"{n}: {s}")


CASES = [(2, 4), (2, 5), (3, 5), (3, 6)]  # (K, M), M >= K + 2: stashed versions lag behind


@pytest.mark.parametrize(("k", "m"), CASES)
@pytest.mark.parametrize("recompute", [False, True])
def test_one_f_one_b_equals_the_update_rule(k: int, m: int, recompute: bool) -> None:
    model, stages, x, y = setup(k, 2 * m)
    schedule = one_f_one_b(k, m)
    c = versions_used(schedule, k, m)
    assert c == [[max(0, mb - (k - 1 - j)) for mb in range(m)] for j in range(k)]
    want, want_loss = stashed_sgd(model, owners(model, stages), x.tensor_split(m),
                                  y.tensor_split(m), c)

    loss = run(stages, schedule, m, x, y, recompute=[recompute] * k)

    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_weights(model, want)
    assert all(p.grad is None for p in model.parameters())  # zero_grad after every update


def test_gpipe_every_forward_on_version_zero() -> None:
    """GPipe runs every forward before any backward: c(k, m) = 0, so the M updates
    all use the starting weights' gradients."""
    k, m = 3, 5
    model, stages, x, y = setup(k, 2 * m)
    schedule = gpipe(k, m)
    c = versions_used(schedule, k, m)
    assert c == [[0] * m] * k
    want, want_loss = stashed_sgd(model, owners(model, stages), x.tensor_split(m),
                                  y.tensor_split(m), c)
    loss = run(stages, schedule, m, x, y, recompute=[True, False, True])
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_weights(model, want)


@pytest.mark.parametrize(("k", "m"), CASES)
def test_stashing_matters(k: int, m: int) -> None:
    """Without stashing, B(k, m) would use the live weights, version m (and with the
    forward recomputed, so would F): that rule gives other weights, far beyond the
    tolerance, so the tests above can tell the two apart."""
    model, stages, x, y = setup(k, 2 * m)
    schedule = one_f_one_b(k, m)
    c = versions_used(schedule, k, m)
    live = [list(range(m))] * k
    assert c != live
    owned, xs, ys = owners(model, stages), x.tensor_split(m), y.tensor_split(m)
    stashed, _ = stashed_sgd(model, owned, xs, ys, c)
    unstashed, _ = stashed_sgd(model, owned, xs, ys, live)

    run(stages, schedule, m, x, y)

    gap = max((stashed[n] - unstashed[n]).abs().max().item() for n in stashed)
    assert gap > 1e-6
    assert_weights(model, stashed)


def test_with_replicated_stage() -> None:
    """Weight stashing and a replicated stage 0 (2-1-1) compose: the same rule."""
    k, m = 3, 5
    model, stages, x, y = setup(k, 4 * m)
    schedule = one_f_one_b(k, m)
    c = versions_used(schedule, k, m)
    want, want_loss = stashed_sgd(model, owners(model, stages), x.tensor_split(m),
                                  y.tensor_split(m), c)
    loss = run(stages, schedule, m, x, y, replicas=(2, 1, 2), recompute=[True, False, False])
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_weights(model, want)


def test_micro_batches_starting_on_one_version_share_its_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At most one parameter copy per micro-batch in flight, fewer where several
    start on the same version: one copy per distinct version a stage uses."""
    k, m = 3, 5
    _, stages, x, y = setup(k, 2 * m)
    copies: list[set[int]] = [set() for _ in range(k)]
    held: list[Any] = []  # every copy stays alive, so no two of them share an id()

    stash_of = WeightStashes.stash

    def counting(self: WeightStashes, j: int, dev: Any) -> Any:
        stash = stash_of(self, j, dev)
        held.append(next(iter(stash.values())))
        copies[j].add(id(held[-1]))
        return stash

    monkeypatch.setattr(WeightStashes, "stash", counting)
    for schedule in (gpipe(k, m), one_f_one_b(k, m)):
        for s in copies:
            s.clear()
        runner = PipelineRunner(stages, schedule=schedule, microbatches=m,
                                flatten_inputs=flatten_x, build_output=output_of("y"),
                                weight_stashing=True)
        optimizers = [torch.optim.SGD(stage.parameters(), lr=LR) for stage in stages]
        runner.step((x,), y, F.mse_loss, optimizers=optimizers)
        c = versions_used(schedule, k, m)
        assert [len(s) for s in copies] == [len(set(row)) for row in c]


class SineBetween(Chain):
    """Two blocks with a parameter-free sine between them: a stage of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[1](torch.sin(self.blocks[0](x))))


def test_stage_without_parameters_takes_no_optimizer() -> None:
    k, m = 3, 5
    torch.manual_seed(0)
    model = SineBetween(2).double()
    stages: list[nn.Module] = [
        Part(("x",), ("h0",), lambda self, x: self.block(x), block=model.blocks[0]),
        Part(("h0",), ("h1",), lambda self, h: torch.sin(h)),
        Part(("h1",), ("y",), lambda self, h: self.head(self.block(h)),
             block=model.blocks[1], head=model.head),
    ]
    _, _, x, y = setup(k, 2 * m)
    schedule = one_f_one_b(k, m)
    want, want_loss = stashed_sgd(model, owners(model, stages), x.tensor_split(m),
                                  y.tensor_split(m), versions_used(schedule, k, m))
    runner = PipelineRunner(stages, schedule=schedule, microbatches=m, flatten_inputs=flatten_x,
                            build_output=output_of("y"), weight_stashing=True)
    optimizers = [torch.optim.SGD(stages[0].parameters(), lr=LR), None,
                  torch.optim.SGD(stages[2].parameters(), lr=LR)]
    loss = runner.step((x,), y, F.mse_loss, optimizers=optimizers)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_weights(model, want)


def test_generated_pipedream_package(tmp_path: Path) -> None:
    """A "pipedream" plan's package stashes weights by default (WEIGHT_STASHING) and
    follows the rule, here with stage 1 of 3 replicated."""
    k, m = 3, 5
    model, _, x, y = setup(k, 4 * m)
    package = generated_package(tmp_path / "pkg", model, x[:4], (1, 2, 1), "pipedream", m)
    assert package.runner.WEIGHT_STASHING is True and package.runner.REPLICAS == (1, 2, 1)
    assert [tuple(t) for t in package.SCHEDULE] == one_f_one_b(k, m)
    generated = package.build_stages(model)
    c = versions_used(package.SCHEDULE, k, m)
    want, want_loss = stashed_sgd(model, owners(model, generated), x.tensor_split(m),
                                  y.tensor_split(m), c)
    runner = package.PipelineRunner(generated)
    optimizers = [torch.optim.SGD(stage.parameters(), lr=LR) for stage in generated]
    loss = runner.step((x,), y, F.mse_loss, optimizers=optimizers)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_weights(model, want)


def test_user_errors() -> None:
    _, stages, x, y = setup(2, 8)
    runner = PipelineRunner(stages, schedule=one_f_one_b(2, 4), microbatches=4,
                            flatten_inputs=flatten_x, build_output=output_of("y"),
                            weight_stashing=True)
    sgd = [torch.optim.SGD(stage.parameters(), lr=LR) for stage in stages]
    with pytest.raises(ValueError, match=r"pass step\(\.\.\., optimizers=\[\.\.\.\]\) with one "
                                         r"optimizer per stage \(2\)"):
        runner.step((x,), y, F.mse_loss)
    with pytest.raises(ValueError, match="got 1 optimizers for 2 stages"):
        runner.step((x,), y, F.mse_loss, optimizers=sgd[:1])
    with pytest.raises(ValueError, match=r"optimizers\[1\] is None, but stage 1 has "
                                         r"trainable parameters \('block\.0\.weight'"):
        runner.step((x,), y, F.mse_loss, optimizers=[sgd[0], None])
    crossed = [torch.optim.SGD(stages[1].parameters(), lr=LR), sgd[1]]
    with pytest.raises(ValueError, match=r"optimizers\[0\] updates parameter 'block\.0\.weight' "
                                         r"of stage 1, which is not a parameter of stage 0"):
        runner.step((x,), y, F.mse_loss, optimizers=crossed)

    _, tied_stages = test_runtime.make(torch.float64)
    with pytest.raises(ValueError, match="parameter 'tied' of stage 0 is also bound into "
                                         "stage 2"):
        PipelineRunner(tied_stages, schedule=one_f_one_b(3, 2), microbatches=2,
                       flatten_inputs=test_runtime.flatten_inputs,
                       build_output=test_runtime.build_output, weight_stashing=True)

    plain = PipelineRunner(stages, schedule=one_f_one_b(2, 4), microbatches=4,
                           flatten_inputs=flatten_x, build_output=output_of("y"))
    with pytest.warns(UserWarning, match="weight_stashing=False, so they are ignored"):
        plain.step((x,), y, F.mse_loss, optimizers=sgd)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recompute", [False, True])
def test_cuda_streams_equal_the_update_rule(recompute: bool) -> None:
    """Every stage on cuda:0 with its own stream; stage 0 replicated, its replica 1
    on the CPU: the same weights as the rule computed on the CPU."""
    k, m = 3, 5
    model, stages, x, y = setup(k, 4 * m)
    c = versions_used(one_f_one_b(k, m), k, m)
    want, want_loss = stashed_sgd(model, owners(model, stages), x.tensor_split(m),
                                  y.tensor_split(m), c)
    model.cuda()
    devices = [["cuda:0", "cpu"], "cuda:0", "cuda:0"]
    loss = run(stages, one_f_one_b(k, m), m, x.cuda(), y.cuda(), devices=devices,
               replicas=(2, 1, 1), recompute=[recompute] * k)
    torch.testing.assert_close(loss.cpu(), want_loss, rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        assert p.device.type == "cuda", name
        torch.testing.assert_close(p.detach().cpu(), want[name], rtol=1e-10, atol=1e-10)
