"""Replicated stages (PipeDream's "2-1-1"): a stage run data-parallel on r chunks of
every micro-batch leaves the loss, outputs and gradients equal to the unsplit
model's (the transparency rule), for an MLP, a transformer block (LayerNorm, a
causal mask and a non-batched position term crossing stages, a skip from stage 0
to stage 2) and test_runtime's model (a skip, a tied weight, a pytree value with
an int leaf); both schedule tables, with and without recompute."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.frontend import trace
from fxpipe.passes import annotate_all
from fxpipe.runtime import PipelineRunner
from fxpipe.schedules import gpipe, one_f_one_b
from tests.codegen._models import (
    assert_runner_matches,
    import_package,
    mini_batch,
    traced,
    write_package,
)
from tests.codegen._plans import contiguous_plan

from . import test_runtime
from ._parts import (
    HEADS,
    VOCAB,
    Chain,
    Part,
    T,
    TinyTransformer,
    chain_stages,
    flatten_ids,
    flatten_x,
    generated_package,
    output_of,
    token_loss,
    transformer_stages,
)

BATCH = 12
TOL = {"rtol": 1e-12, "atol": 1e-12}
assert HEADS > 1 and T not in (BATCH, BATCH // 2, BATCH // 4)  # pos is never taken as batched


class Case(NamedTuple):
    model: nn.Module
    stages: list[nn.Module]
    flatten_inputs: Callable[..., dict[str, Any]]
    build_output: Callable[[dict[str, Any]], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    inputs: tuple[Any, ...]
    target: torch.Tensor


def mlp() -> Case:
    torch.manual_seed(0)
    model = Chain(3).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 6, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, 2, generator=g, dtype=torch.float64)
    return Case(model, chain_stages(model), flatten_x, output_of("y"), F.mse_loss, (x,), y)


def transformer() -> Case:
    torch.manual_seed(0)
    model = TinyTransformer().double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, T), generator=g)
    target = torch.randint(0, VOCAB, (BATCH, T), generator=g)
    return Case(model, transformer_stages(model), flatten_ids, output_of("logits"), token_loss,
                (ids,), target)


def skip_and_tied() -> Case:
    model, stages = test_runtime.make(torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 6, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, 3, generator=g, dtype=torch.float64)
    return Case(model, stages, test_runtime.flatten_inputs, test_runtime.build_output,
                test_runtime.loss_fn, (x,), y)


MODELS = {"mlp": mlp, "transformer": transformer, "skip_and_tied": skip_and_tied}
# (M, replicas): micro-batches of 6 or 3 samples, chunks of 3, 2 or 1 samples
SETTINGS = [(2, (2, 1, 1)), (2, (1, 3, 1)), (2, (2, 2, 3)), (4, (1, 1, 3)), (4, (2, 1, 2))]


def make_runner(case: Case, m: int, replicas: tuple[int, ...], schedule_fn: Any = one_f_one_b,
                recompute: bool = False, devices: Any = None) -> PipelineRunner:
    k = len(case.stages)
    return PipelineRunner(
        case.stages, devices, schedule=schedule_fn(k, m), microbatches=m,
        flatten_inputs=case.flatten_inputs, build_output=case.build_output,
        recompute=[recompute] * k, replicas=replicas,
    )


def reference(case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    case.model.zero_grad(set_to_none=True)
    loss = case.loss_fn(case.model(*case.inputs), case.target)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def count_calls(stages: list[nn.Module]) -> list[int]:
    """calls[k]: how many times stage k's module ran (once per replica chunk)."""
    calls = [0] * len(stages)

    def hook(k: int) -> Callable[..., None]:
        def count(*_: Any) -> None:
            calls[k] += 1
        return count

    for k, stage in enumerate(stages):
        stage.register_forward_pre_hook(hook(k))
    return calls


def assert_grads(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, **TOL, msg=lambda s, name=name: f"{name}: {s}")


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("schedule_fn", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("m", "replicas"), SETTINGS)
@pytest.mark.parametrize("recompute", [False, True])
def test_step_equals_unsplit(name: str, schedule_fn: Any, m: int, replicas: tuple[int, ...],
                             recompute: bool) -> None:
    case = MODELS[name]()
    want_loss, want_grads = reference(case)
    calls = count_calls(case.stages)

    loss = make_runner(case, m, replicas, schedule_fn, recompute).step(
        case.inputs, case.target, case.loss_fn
    )

    # every micro-batch ran once per replica (twice with recompute): the split happened
    assert calls == [m * r * (2 if recompute else 1) for r in replicas]
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads(case.model, want_grads)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(("m", "replicas"), SETTINGS)
def test_forward_equals_unsplit(name: str, m: int, replicas: tuple[int, ...]) -> None:
    case = MODELS[name]()
    calls = count_calls(case.stages)
    out = make_runner(case, m, replicas).forward(*case.inputs)
    with torch.no_grad():
        want = case.model(*case.inputs)
    assert calls == [m * r for r in replicas]
    if isinstance(want, dict):
        assert out.keys() == want.keys()
        out, want = list(out.values()), list(want.values())
    torch.testing.assert_close(out, want, **TOL)


def test_chunks_see_their_share_and_unbatched_values_whole() -> None:
    """Stage 1 of the transformer on 3 replicas of a 6-sample micro-batch: each
    replica gets 2 samples of tok, and pos (T, D) and mask (1, 1, T, T) whole."""
    case = transformer()
    seen: list[tuple[tuple[int, ...], ...]] = []
    case.stages[1].register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(tuple(tuple(kwargs[n].shape) for n in kwargs)),
        with_kwargs=True,
    )
    make_runner(case, 2, (1, 3, 1)).forward(*case.inputs)
    d = case.model.emb.embedding_dim
    assert seen == [((2, T, d), (T, d), (1, 1, T, T))] * 6


def test_replicas_on_devices_of_their_own() -> None:
    """devices[k] as a list: replica 1 of stage 0 runs on a device that is not the
    stage's ("cpu:0" compares unequal to "cpu" while being the same memory), so it
    runs with copies of the stage's Parameters whose gradients are added back."""
    case = skip_and_tied()
    want_loss, want_grads = reference(case)
    devices = [["cpu", "cpu:0"], "cpu", ["cpu", "cpu:0"]]
    runner = make_runner(case, 2, (2, 1, 2), recompute=True, devices=devices)
    loss = runner.step(case.inputs, case.target, case.loss_fn)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads(case.model, want_grads)
    assert runner._bound == {}  # the copies are unbound after the step
    assert all(type(p) is nn.Parameter for p in case.model.parameters())


def test_user_errors() -> None:
    case = mlp()
    with pytest.raises(ValueError, match="replicas has 2 entries for 3 stages"):
        make_runner(case, 2, (2, 1))
    with pytest.raises(ValueError, match="stage 1 has replicas=0"):
        make_runner(case, 2, (1, 0, 1))
    with pytest.raises(ValueError, match=r"stage 0 has 2 replicas but devices\[0\] lists 3"):
        make_runner(case, 2, (2, 1, 1), devices=[["cpu"] * 3, "cpu", "cpu"])
    x, y = case.inputs[0], case.target
    too_many = make_runner(case, 4, (1, 4, 1))  # micro-batches of 3 samples
    with pytest.raises(ValueError, match="stage 1 has 4 replicas, more than the 3 samples of "
                                         "micro-batch 0: pass a mini-batch of at least 16"):
        too_many.step((x,), y, F.mse_loss)
    with pytest.raises(ValueError, match="no graph input is a tensor with a batch dimension"):
        make_runner(case, 2, (2, 1, 1)).forward(torch.tensor(1.0, dtype=torch.float64))


def test_batch_norm_in_training_warns() -> None:
    torch.manual_seed(0)
    norm, head = nn.BatchNorm1d(4), nn.Linear(4, 2)
    stages: list[nn.Module] = [
        Part(("x",), ("h",), lambda self, x: self.norm(x), norm=norm),
        Part(("h",), ("y",), lambda self, h: self.head(h), head=head),
    ]
    runner = PipelineRunner(stages, schedule=one_f_one_b(2, 2), microbatches=2,
                            flatten_inputs=flatten_x, build_output=output_of("y"),
                            replicas=(2, 1))
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match=r"Stage 0 runs on 2 replicas and its 'norm' "
                                         r"\(BatchNorm1d\) is in training mode"):
        runner.forward(x)
    norm.eval()
    with torch.no_grad():
        want = head(norm(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(runner.forward(x), want)  # eval mode: per sample, exact


def test_generated_package_runs_the_plans_replicas(tmp_path: Path) -> None:
    """A plan's StagePlan.replicas become runner.py's REPLICAS, the generated
    PipelineRunner's default; the package stays transparent."""
    case = mlp()
    want_loss, want_grads = reference(case)
    package = generated_package(tmp_path / "pkg", case.model, case.inputs[0][:3],
                                (2, 1, 3), "1f1b", microbatches=2)
    assert package.runner.REPLICAS == (2, 1, 3)
    assert package.runner.WEIGHT_STASHING is False
    stages = package.build_stages(case.model)
    runner = package.PipelineRunner(stages)
    assert runner.replicas == [2, 1, 3] and not runner.weight_stashing
    calls = count_calls(stages)
    loss = runner.step(case.inputs, case.target, case.loss_fn)
    assert calls == [4, 2, 6]
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert_grads(case.model, want_grads)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recompute", [False, True])
def test_cuda_replicas_on_two_devices(recompute: bool) -> None:
    """Stage 0's replica 1 on the CPU, everything else on cuda:0 with its streams:
    the loss and gradients equal the unsplit model's."""
    case = transformer()
    want_loss, want_grads = reference(case)
    case.model.cuda()
    devices = [["cuda:0", "cpu"], "cuda:0", ["cuda:0", "cuda:0"]]
    runner = make_runner(case, 2, (2, 1, 2), recompute=recompute, devices=devices)
    inputs = tuple(t.cuda() for t in case.inputs)
    loss = runner.step(inputs, case.target.cuda(), case.loss_fn)
    torch.testing.assert_close(loss.cpu(), want_loss, rtol=1e-10, atol=1e-10)
    for name, p in case.model.named_parameters():
        assert p.grad is not None and p.grad.device.type == "cuda", name
        torch.testing.assert_close(p.grad.cpu(), want_grads[name], rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        out = runner.forward(*inputs)
        torch.testing.assert_close(out, case.model(*inputs), rtol=1e-10, atol=1e-10)


class WritesItsInput(nn.Module):
    """``y.relu_()`` in the first stage, ``y`` (the written value) read again in the last."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.relu_()
        h = self.b(torch.tanh(self.a(x) * y))
        return self.c(h) * y


@pytest.mark.parametrize("recompute", [False, True])
def test_replicas_write_their_own_copies_of_an_input_later_stages_read(
        tmp_path: Path, recompute: bool) -> None:
    """Each replica writes its own copy of ``y`` (chunks of one tensor share its version
    counter); the last stage reads the copies joined back, so it sees the write."""
    torch.manual_seed(0)
    model = WritesItsInput().double()
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(BATCH, 6, generator=g, dtype=torch.float64) for _ in range(2))
    traced = trace(model, (x[:2], y[:2].clone()))
    plan = contiguous_plan(traced.gm.graph, 3, replicas=(2, 2, 2),
                           recompute=(recompute,) * 3)
    write_package(tmp_path / "pkg", traced, plan)
    package = import_package(tmp_path / "pkg")
    stages = package.build_stages(model)
    assert stages[0].WRITES == ("y",) and "y" in stages[2].INPUTS
    runner = package.PipelineRunner(stages)
    assert_runner_matches(runner, model, (x, y), {}, None, lambda out, _: out.square().mean())


@pytest.mark.parametrize("replicas", [(1, 2, 1), (2, 1, 1), (2, 2, 1)])
def test_a_batch_count_crossing_replica_counts_is_recounted(
        tmp_path: Path, replicas: tuple[int, ...]) -> None:
    """GPT's attention reads ``B, T = x.size()`` in one stage and views with B in the next:
    received from a stage run on another share of the micro-batch, B was that stage's
    count (a 2-row view of 4 rows failed, or the reverse). The next stage counts its own."""
    source, tr = traced("gpt")
    annotate_all(tr.gm, *tr.flat_inputs)  # as the compiler does: the counts need shapes
    plan = contiguous_plan(tr.gm.graph, 3, microbatches=2, replicas=replicas)
    files = write_package(tmp_path / "pkg", tr, plan)
    assert "        size_3 = add_2.size(0)  # this stage's own rows\n" in files["stage1.py"]
    package = import_package(tmp_path / "pkg")
    runner = package.PipelineRunner(package.build_stages(source.model))
    assert_runner_matches(runner, source.model, mini_batch(source.args), {},
                          mini_batch(source.target), source.loss_fn, what=str(replicas))


class OwnLoss(nn.Module):
    """A model that computes its own loss (nanoGPT's ``model(x, y) -> (out, loss)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.b(torch.relu(self.a(x)))
        return out, F.mse_loss(out, y)


def test_a_replicated_stage_returning_its_own_loss_is_refused(tmp_path: Path) -> None:
    """Each replica's loss is of its own rows: taking replica 0's (as a value with no batch
    dimension is taken) trained on half the samples, silently."""
    torch.manual_seed(0)
    model = OwnLoss()
    x, y = torch.randn(BATCH, 6), torch.randn(BATCH, 6)
    traced_model = trace(model, (x[:4], y[:4]))
    plan = contiguous_plan(traced_model.gm.graph, 2, replicas=(1, 2))
    write_package(tmp_path / "pkg", traced_model, plan)
    package = import_package(tmp_path / "pkg")
    runner = package.PipelineRunner(package.build_stages(model))
    with pytest.raises(ValueError, match=r"a replicated stage returns a tensor of shape \(\) "
                       r"that has no row per sample and differs between its replicas"):
        runner.step((x, y), None, lambda out, _: out[1])
    assert all(p.grad is None for p in model.parameters())
