"""The runner's inputs: a call the unsplit model refuses (batched inputs or a target of
different rows, a graph input of the wrong kind or rank, arguments the forward does not
take) is refused in one line before anything runs; a 0-dim output, which micro-batches
cannot rebuild, is refused; a graph input the model writes in place is written in the
caller's tensor, as the model writes it. The property test draws calls and checks that
the runner refuses exactly those the model raises on, and agrees with it on the others.

# B: rows of the mini-batch, M: micro-batches.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from codegen._models import grads, import_package, write_package
from codegen._plans import contiguous_plan
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

from fxpipe.frontend import trace
from fxpipe.runtime import PipelineRunner
from fxpipe.schedules import gpipe

from ._parts import Part, flatten_x, output_of

M = 4


class Pair(nn.Module):
    """Two batched inputs joined along dim 1: rows that differ raise (no broadcasting)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 6)
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(torch.cat([self.a(x), self.b(y)], dim=1)))


class WritesInput(nn.Module):
    """Writes its input in place before reading it (x becomes 2x + 1 for the caller)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2).add_(1)
        return self.b(torch.tanh(self.a(x)))


def package(directory: Path, model: nn.Module, example: tuple[torch.Tensor, ...]
            ) -> types.ModuleType:
    """``model`` traced on ``example``, cut into 2 stages run 1F1B on M micro-batches."""
    traced = trace(model, example)
    write_package(directory, traced, contiguous_plan(traced.gm.graph, 2, schedule="1f1b",
                                                     microbatches=M))
    return import_package(directory)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = Pair().double()
    pkg = package(tmp_path_factory.mktemp("pair"), model,
                  (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)))
    return model, pkg.PipelineRunner(pkg.build_stages(model))


def batch(rows: int, features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, features, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed + rows))


def labels(rows: int) -> torch.Tensor:
    return torch.arange(rows) % 5


def refused(call: Callable[[], Any], model: nn.Module, match: str | None) -> None:
    """``call`` raises one line matching ``match`` and leaves no gradient."""
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ rows that differ


def test_batched_inputs_of_different_rows_are_refused(pair: tuple[nn.Module, Any]) -> None:
    model, runner = pair
    x, y = batch(16, 4), batch(4, 3)
    with pytest.raises(RuntimeError):  # the model: cat along dim 1 needs equal rows
        model(x, y)
    match = (r"^the batched inputs have different numbers of rows along dim 0 \(x: 16, y: 4\): "
             r"pass one row per sample in each, all with the same batch size$")
    refused(lambda: runner.forward(x, y), model, match)
    refused(lambda: runner.step((x, y), labels(16), F.cross_entropy), model, match)
    refused(lambda: runner.step({"x": x, "y": y}, labels(16), F.cross_entropy), model, match)


@pytest.mark.filterwarnings("ignore:Using a target size")  # mse_loss, before it raises
def test_a_target_of_other_rows_than_the_inputs_is_refused(pair: tuple[nn.Module, Any]) -> None:
    """4 target rows against 16 samples in M = 4 micro-batches: each micro-batch would
    pair 4 samples with one label, which a mean-squared loss broadcasts."""
    model, runner = pair
    x, y = batch(16, 4), batch(16, 3)
    target = torch.randn(4, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        F.mse_loss(model(x, y), target)
    refused(lambda: runner.step((x, y), target, F.mse_loss), model,
            r"^the target's rows along dim 0 \(target: 4\) differ from the inputs' "
            r"\(x: 16, y: 16\): pass one row of the target per sample of the inputs$")
    refused(lambda: runner.step((x, y), {"labels": labels(15)},
                                lambda out, t: F.cross_entropy(out, t["labels"])), model,
            r"\(target\['labels'\]: 15\) differ from the inputs' \(x: 16, y: 16\)")


# ------------------------------------------------------------------ malformed calls


@pytest.mark.parametrize(("x", "named"), [
    (None, "as None"),
    ([torch.zeros(8, 4)], "as a list of 1"),
    (3, "as 3"),
    (torch.zeros(8, dtype=torch.float64), r"of shape \(8,\)"),  # split, it would be (2,)
    (torch.zeros(8, 4, 1, dtype=torch.float64), r"of shape \(8, 4, 1\)"),
])
def test_a_graph_input_of_another_kind_is_named_as_passed(
        pair: tuple[nn.Module, Any], x: Any, named: str) -> None:
    model, runner = pair
    with pytest.raises((TypeError, RuntimeError)):
        model(x, batch(8, 3))
    match = rf"^Stage\d received 'x' {named}, but the model was traced with .*\(\*, 4\)"
    refused(lambda: runner.forward(x, batch(8, 3)), model, match)
    refused(lambda: runner.step((x, batch(8, 3)), labels(8), F.cross_entropy), model, match)


def test_arguments_the_forward_does_not_take_are_named(pair: tuple[nn.Module, Any]) -> None:
    model, runner = pair
    x, y = batch(8, 4), batch(8, 3)
    refused(lambda: runner.forward(x), model,
            r"^runner.forward was given \(a tensor of shape \(8, 4\)\), but the model's "
            r"forward takes \(x, y\) \(missing a required argument: 'y'\)")
    refused(lambda: runner.forward(x, y, x), model, r"too many positional arguments")
    refused(lambda: runner.step({"x": x, "z": y}, labels(8), F.cross_entropy), model,
            r"^runner.step's inputs was given \(x=a tensor of shape \(8, 4\), z=a tensor of "
            r"shape \(8, 3\)\), but the model's forward takes \(x, y\)")
    refused(lambda: runner.step(None, labels(8), F.cross_entropy), model,
            r"given \(None\), but the model's forward takes \(x, y\)")


# ------------------------------------------------------------------ outputs


def scalar_stages(model: nn.Sequential) -> list[nn.Module]:
    """Stage 0 runs the first layer, stage 1 the second and returns a mean over the batch."""
    return [Part(("x",), ("h",), lambda self, x: torch.tanh(self.first(x)), first=model[0]),
            Part(("h",), ("y",), lambda self, h: self.second(h).pow(2).mean(),
                 second=model[1])]


def test_a_0_dim_output_is_refused_unless_one_microbatch_is_the_batch() -> None:
    """The model's mean over 6 samples is not the 4 micro-batches' means stacked (it
    was), nor their mean (micro-batches of 2, 2, 1 and 1 samples)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).double()
    runner = PipelineRunner(scalar_stages(model), schedule=gpipe(2, M), microbatches=M,
                            flatten_inputs=flatten_x, build_output=output_of("y"))
    x = batch(6, 4)
    with torch.no_grad():
        want = model[1](torch.tanh(model[0](x))).pow(2).mean()
        with pytest.raises(ValueError, match=r"^the model's output is a 0-dim tensor .*: the "
                                             r"runner cannot rebuild the mini-batch's value "
                                             r"from its 4 micro-batches'; return per-sample "
                                             r"values .* or compute it in loss_fn$"):
            runner.forward(x)
        one = runner.forward(x[:1])
        assert one.shape == () == want.shape
        torch.testing.assert_close(one, model[1](torch.tanh(model[0](x[:1]))).pow(2).mean())


def test_an_output_whose_rows_do_not_count_the_samples_is_refused() -> None:
    """A mean over the batch (3 features, for 6 samples) would be concatenated to 12."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).double()
    stages = scalar_stages(model)
    stages[1] = Part(("h",), ("y",), lambda self, h: (self.second(h).mean(0), h.size(0)),
                     second=model[1])
    stages[1].OUTPUTS = ("y", "n")
    runner = PipelineRunner(stages, schedule=gpipe(2, M), microbatches=M,
                            flatten_inputs=flatten_x, build_output=lambda v: (v["y"], v["n"]))
    with torch.no_grad(), pytest.raises(ValueError, match=r"^the model's output\[0\] has "
                                                          r"\[3, 3, 3, 3\] rows along dim 0 "
                                                          r"in micro-batches of \[2, 2, 1, 1\]"):
        runner.forward(batch(6, 4))
    runner.build_output = lambda v: v["n"]  # the rows seen: 2, 2, 1, 1, not the batch's 6
    with torch.no_grad(), pytest.raises(ValueError, match=r"^the model's output differs "
                                                          r"between micro-batches \(2, 2, "):
        runner.forward(batch(6, 4))


# ------------------------------------------------------------------ in-place writes


def test_a_graph_input_written_in_place_is_written_for_the_caller(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = WritesInput().double()
    pkg = package(tmp_path / "pkg", model, (batch(8, 4),))
    runner = pkg.PipelineRunner(pkg.build_stages(model))
    target = torch.randn(6, 3, dtype=torch.float64)
    for rows in (6, 1):  # uneven micro-batches, and one
        x, mine = batch(rows, 4), batch(rows, 4)
        with torch.no_grad():
            want = model(x)
            got = runner.forward(mine)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(mine, x)  # 2x + 1, as the model left it
    x, mine = batch(6, 4), batch(6, 4)
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), target).backward()
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    runner.step((mine,), target, F.mse_loss)
    torch.testing.assert_close(mine, x)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, want_grads[name], msg=name)


def test_a_shared_input_written_in_place_is_written_once() -> None:
    """A shared (T, T) input that the first stage doubles in place: each micro-batch
    sees it doubled once, as in the model, and so does the caller (the runner wrote the
    caller's tensor once per micro-batch, each reading the one before's write)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()

    def first(self: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ mask.mul_(2)

    stage = Part(("x", "mask"), ("h",), first, lin=lin)
    stage.WRITES = ("mask",)
    runner = PipelineRunner([stage, Part(("h",), ("y",), lambda self, h: torch.tanh(h))],
                            schedule=gpipe(2, M), microbatches=M,
                            flatten_inputs=lambda x, mask: {"x": x, "mask": mask},
                            build_output=output_of("y"), shared_inputs=("mask",))
    x, mask = batch(8, 3), torch.ones(3, 3, dtype=torch.float64).triu()
    mine = mask.clone()
    with torch.no_grad():
        want = torch.tanh(lin(x) @ mask.mul_(2))
        torch.testing.assert_close(runner.forward(x, mine), want)
    torch.testing.assert_close(mine, mask)


# ------------------------------------------------------------------ the property


ROWS, SAME = [1, 3, 4, 8], 0  # SAME: as many rows as x
KINDS = ("tensor", "none", "list", "int", "1-D", "3-D", "features")
FORMS = ("positional", "keywords", "missing", "extra")


def _value(kind: str, rows: int, features: int, seed: int) -> Any:
    x = batch(rows, features, seed)
    return {"tensor": x, "none": None, "list": [x], "int": 3, "1-D": x[:, 0],
            "3-D": x.unsqueeze(-1), "features": batch(rows, features + 1, seed)}[kind]


def _call(form: str, x: Any, y: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return {"positional": ((x, y), {}), "keywords": ((), {"x": x, "y": y}),
            "missing": ((x,), {}), "extra": ((x, y, y), {})}[form]


def _fresh(value: Any) -> Any:
    return [_fresh(v) for v in value] if isinstance(value, list) else (
        value.clone() if isinstance(value, torch.Tensor) else value)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(rows=st.tuples(st.sampled_from(ROWS), *[st.sampled_from([SAME] * 8 + ROWS)] * 2),
       kinds=st.tuples(*[st.sampled_from(KINDS[:1] * 18 + KINDS)] * 2),
       form=st.sampled_from(FORMS[:2] * 6 + FORMS), train=st.booleans())
def test_the_runner_refuses_exactly_what_the_model_refuses(
        pair: tuple[nn.Module, Any], rows: tuple[int, int, int], kinds: tuple[str, str],
        form: str, train: bool) -> None:
    model, runner = pair
    rows_x, rows_y, rows_target = (rows[0] if n == SAME else n for n in rows)
    args, kwargs = _call(form, _value(kinds[0], rows_x, 4, 1), _value(kinds[1], rows_y, 3, 2))
    target = labels(rows_target)
    model.zero_grad(set_to_none=True)
    try:
        want = model(*_fresh(list(args)), **{k: _fresh(v) for k, v in kwargs.items()})
        if train:
            want = F.cross_entropy(want, target)
            want.backward()
    except (TypeError, RuntimeError, ValueError, IndexError):
        want = None
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)

    def run() -> Any:
        if train:
            return runner.step(kwargs if form == "keywords" else args, target, F.cross_entropy)
        with torch.no_grad():
            return runner.forward(*args, **kwargs)
    event("the model raises" if want is None else "the model runs")
    if want is None:
        refused(run, model, None)
        return
    torch.testing.assert_close(run(), want.detach())
    got_grads = grads(model)
    assert got_grads.keys() == want_grads.keys()
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], msg=name)
