"""The example models, traced once per test session, and generated packages loaded from disk."""

from __future__ import annotations

import copy
import functools
import itertools
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpipe.codegen import generate, load_package
from fxpipe.codegen.stages import LINE_LENGTH
from fxpipe.frontend import ModelSource, Traced, load_model_file, trace
from fxpipe.plan import Plan
from fxpipe.runtime.loading import import_file as import_file_by_path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SYMBOLIC = ["mlp", "resnet", "unet", "gpt", "llama"]
EXPORTED = ["hf_gpt2", "hf_llama", "hf_bert", "hf_t5", "hf_vit"]
MODELS = SYMBOLIC + EXPORTED

_counter = itertools.count()

# The rule set generated files are held to, at the package's own line length (A: no name
# shadows a builtin).
RUFF = [
    sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache",
    "--select", "E,F,W,I,B,UP,SIM,RUF,A", "--line-length", str(LINE_LENGTH),
    "--target-version", "py310",
]


def ruff(path: Path) -> str:
    """ruff's complaints about the files under ``path``; empty when it passes. Run from
    ``path``, as a package on its own: a module of this repository that a stage
    imports (tests.codegen._wrapped) is a third-party import there."""
    done = subprocess.run([*RUFF, "."], capture_output=True, text=True, cwd=path)
    return "" if done.returncode == 0 else done.stdout + done.stderr


@functools.cache
def traced(name: str) -> tuple[ModelSource, Traced]:
    """The example model and its traced graph; shared by the tests (zero grads before use)."""
    source = load_model_file(str(EXAMPLES / f"{name}.py"))
    return source, trace(source.model, source.args, source.kwargs,
                         batch_dims=source.batch_dims)


def write_package(directory: Path, traced: Traced, plan: Plan) -> dict[str, str]:
    files = generate(traced, plan)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text, encoding="utf-8")
    return files


def import_package(directory: Path) -> types.ModuleType:
    """Import a generated package from ``directory`` under a fresh module name."""
    return load_package(directory)


def import_and_forget(directory: Path) -> types.ModuleType:
    """Import the generated package in ``directory`` under a fresh name, then drop it and
    its submodules from ``sys.modules`` (the module objects keep working): a run that
    imports many packages, as the fuzzer does, keeps ``sys.modules`` small."""
    name = f"fxpipe_generated_package_{next(_counter)}"
    try:
        package = load_package(directory, name)
        _ = package.distributed  # imported lazily, by its name: while the name is known
        return package
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def import_file(path: Path) -> types.ModuleType:
    """Import one generated file on its own, outside its package."""
    return import_file_by_path(path, f"fxpipe_generated_file_{next(_counter)}")


def run_stages(package: types.ModuleType, stages: list[torch.nn.Module], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    """The stages in sequence, values fed by name: no runner, no schedule."""
    values = package.runner.flatten_inputs(*args, **kwargs)
    for stage in stages:
        outputs = stage(**{name: values[name] for name in stage.INPUTS})
        assert isinstance(outputs, tuple) and len(outputs) == len(stage.OUTPUTS)
        values.update(zip(stage.OUTPUTS, outputs, strict=True))
    return package.runner.build_output(values)


def as_plain(output: Any) -> Any:
    """A model output with ModelOutputs as dicts, as build_output writes them."""
    if hasattr(output, "keys") and not isinstance(output, dict):
        return {key: output[key] for key in output.keys()}  # noqa: SIM118 (ModelOutput)
    return output


def leaves(output: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(as_plain(output)) if isinstance(t, torch.Tensor)]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


# torch.testing.assert_close's default (rtol, atol) per dtype, for the float64 fallback below
TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
}


def assert_runner_matches(runner: Any, model: torch.nn.Module, args: tuple[Any, ...],
                          kwargs: dict[str, Any], target: Any, loss_fn: Any, *,
                          what: str = "") -> None:
    """The transparency rule through a generated package's runner: ``runner.step`` gives
    the unsplit model's loss and leaves its gradients, ``runner.forward`` its outputs
    (allclose; float32 summed in another order). ``what`` prefixes the failure messages.
    Zeroes the model's gradients before and after.

    A value that is not allclose to the unsplit model's may still pass, only where the
    unsplit model's own value is measurably off (not allclose to) the same step in
    float64 and the pipeline's is, element by element, no further off float64 than the
    model's plus the usual tolerance: see ``no_further_off``."""
    label = f"{what}: " if what else ""
    model.zero_grad(set_to_none=True)
    loss = runner.step(kwargs if kwargs else args, target, loss_fn)
    pipeline_grads = grads(model)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        got = runner.forward(*args, **kwargs)
    want = model(*args, **kwargs)
    want_loss = loss_fn(want, target)
    want_loss.backward()
    model_grads = grads(model)
    model.zero_grad(set_to_none=True)

    # (name, pipeline's value, model's value, prefix of the failure message)
    pairs = [("loss", torch.as_tensor(loss), want_loss.detach(), f"{label}loss: ")]
    for i, (a, b) in enumerate(zip(leaves(got), leaves(want), strict=True)):
        assert a.shape == b.shape, what
        pairs.append((f"output {i}", a, b.detach(), label))
    assert sorted(pipeline_grads) == sorted(model_grads), what
    pairs += [(key, pipeline_grads[key], value, f"{label}{key}: ")
              for key, value in model_grads.items()]

    failures = []
    for name, a, b, prefix in pairs:
        try:
            torch.testing.assert_close(a, b, msg=lambda m, prefix=prefix: f"{prefix}{m}")
        except AssertionError as error:
            failures.append((name, a, b, error))
    if not failures:
        return
    try:
        truth = float64_step(model, args, kwargs, target, loss_fn)
    except Exception:  # no float64 reference (a dtype-bound model): the plain failure stands
        truth = {}
    for name, a, b, error in failures:
        if name not in truth:
            raise error
        no_further_off(a, b, truth[name], error)


def float64_step(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 target: Any, loss_fn: Any) -> dict[str, torch.Tensor]:
    """The unsplit model's step on a float64 copy, floating inputs cast: the loss, the
    outputs (``output i``) and the gradients by parameter name."""
    copy64 = copy.deepcopy(model).double()
    args, kwargs, target = pytree.tree_map_only(
        torch.Tensor, lambda t: t.double() if t.is_floating_point() else t,
        (args, kwargs, target))
    copy64.zero_grad(set_to_none=True)
    output = copy64(*args, **kwargs)
    loss = loss_fn(output, target)
    loss.backward()
    return {"loss": loss.detach(), **grads(copy64),
            **{f"output {i}": t.detach() for i, t in enumerate(leaves(output))}}


def no_further_off(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor,
                   failure: AssertionError) -> None:
    """``got`` (the pipeline's) is not allclose to ``want`` (the unsplit model's): fail with
    ``failure`` unless ``want`` is itself measurably off ``truth``, its float64 value
    (float32 rounding that crosses a kink, as ReLU's at 0, moves a gradient by far more
    than the tolerance), and ``got`` is, element by element, within that same error
    plus the usual tolerance of ``truth``:
    ``|got - truth| <= |want - truth| + atol + rtol * |truth|``."""
    if got.dtype not in TOLERANCES or want.dtype != got.dtype or got.shape != truth.shape:
        raise failure
    try:
        torch.testing.assert_close(want, truth, check_dtype=False)
    except AssertionError:
        pass  # the unsplit model is measurably off float64: judge both against it
    else:
        raise failure
    rtol, atol = TOLERANCES[got.dtype]
    truth = truth.detach()
    got_off = (got.detach().double() - truth).abs()
    want_off = (want.detach().double() - truth).abs()
    excess = got_off - want_off - (atol + rtol * truth.abs())
    if (excess > 0).any():
        raise AssertionError(
            f"{failure}\nThe unsplit model is off its float64 result by up to "
            f"{want_off.max().item():.3g}, but the pipeline is further off at "
            f"{int((excess > 0).sum())} / {excess.numel()} elements, by up to "
            f"{excess.max().item():.3g} more than the tolerance.") from failure


def mini_batch(value: Any) -> Any:
    """Two micro-batches: the example and the example reversed along dim 0."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: torch.cat([t, t.flip(0)]) if t.dim() else t, value
    )
