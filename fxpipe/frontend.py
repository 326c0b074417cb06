"""Load the user's model file and trace the model into an FX graph.

The model file contract (docs/design.md): the file defines ``build_model()`` and
``example_inputs()`` (one micro-batch, a tuple of positional inputs or a dict
of keyword inputs), optionally ``loss_fn(output, target)`` and
``example_target()``. ``path.py:make_gpt`` names another factory.

Tracing tries ``torch.fx.symbolic_trace`` first (it keeps ``call_module``
nodes, which read best in generated code) and falls back to
``torch.export.export(..., strict=False)``, which captures Hugging Face models;
each tracer's mechanics live in ``fxpipe/tracing/`` (``symbolic.py``, ``export.py``),
and this module says what happened in words: the notes, the errors.

Training does not feed one shape forever (the last batch of an epoch is smaller,
collators pad to the longest sequence), so the graph must compute sizes from its
inputs. ``symbolic_trace`` keeps sizes symbolic by itself; ``torch.export`` is
asked to with ``Dim.AUTO`` on every dimension of every input, and keeps symbolic
the ones the model lets vary. Either way ``Traced.inputs`` records, per graph
input, the traced shape and which dimensions are free (``InputShape``).

A model trained under autocast (``--precision bf16-mixed``) is traced under it too:
``torch.export`` writes into the graph the dtypes the model's Python reads off its
values (an RMSNorm's ``x.to(input_dtype)``, T5's ``if x.dtype == torch.float16``), and
under autocast a matmul's output is bfloat16, so only a trace under autocast computes
what the model computes when it trains so.
"""

from __future__ import annotations

import contextlib
import sysconfig
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fxpipe import meta
from fxpipe.batching import decide_batching
from fxpipe.metadevice import named_state
from fxpipe.runtime.loading import NotPythonError, import_file
from fxpipe.signals import Interrupted
from fxpipe.tracing.attention import attention_calls
from fxpipe.tracing.attention import describe as describe_attention
from fxpipe.tracing.checkpoints import describe as describe_checkpoints
from fxpipe.tracing.checkpoints import plain_calls
from fxpipe.tracing.export import advice as export_advice
from fxpipe.tracing.export import data_sized, export_program, exported_graph
from fxpipe.tracing.functions import applied_functions, describe, kept, refusal
from fxpipe.tracing.hooks import dropped, tensor_hooks
from fxpipe.tracing.records import InputShape, TraceError
from fxpipe.tracing.repeats import export_in_layers, mark_copies
from fxpipe.tracing.symbolic import symbolic_graph

__all__ = [
    "InputShape",
    "ModelFileError",
    "ModelSource",
    "TraceError",
    "Traced",
    "load_model_file",
    "trace",
    "trace_source",
]


class ModelFileError(ValueError):
    """The model file is missing, broken, or does not follow the contract."""


@dataclass
class ModelSource:
    """What a model file provides, built and ready to trace."""

    path: Path
    factory: str
    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[..., torch.Tensor] | None
    target: Any
    batch_dims: Any = None  # what the file's optional batch_dims() returned

    @property
    def label(self) -> str:
        return f"{self.path.name}:{self.factory}"


@dataclass
class Traced:
    """A traced model and the example inputs flattened in placeholder order."""

    gm: torch.fx.GraphModule
    tracer: str  # "symbolic_trace" or "export"
    fallback_reason: str | None  # why symbolic_trace was not used, if it was not
    flat_inputs: tuple[Any, ...]
    notes: tuple[str, ...] = ()
    inputs: tuple[InputShape, ...] = ()  # one per tensor input, in placeholder order
    # batched[i]: flat input i is split into micro-batches along dim 0 (else passed whole
    # to every micro-batch); empty: every input with a dimension is batched
    batched: tuple[bool, ...] = ()
    batching: str = ""  # how that was decided
    # the model traced, which the stages bind (None: a graph traced elsewhere)
    model: torch.nn.Module | None = field(default=None, repr=False, compare=False)

    @property
    def shared_inputs(self) -> tuple[str, ...]:
        """Names of the graph inputs handed whole to every micro-batch."""
        placeholders = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        return tuple(
            name for name, value, batched in zip(placeholders, self.flat_inputs, self.batched,
                                                 strict=True)
            if not batched and any(isinstance(t, torch.Tensor) and t.dim() > 0
                                   for t in pytree.tree_leaves(value))
        )


def load_model_file(spec: str) -> ModelSource:
    """Import ``path.py[:factory]``, build the model and one micro-batch of inputs."""
    path_text, _, factory = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    factory = factory or "build_model"
    path = Path(path_text)
    if not path.is_file():
        raise ModelFileError(
            f"{path}: no such file; pass the path to a Python file that defines build_model()"
        )
    module = _import_file(path)

    build = _find_function(
        module, path, factory, "returning an nn.Module", named_by_user=factory != "build_model"
    )
    model = _call(build, path, factory)
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(
            f"{path}: {factory}() returned {type(model).__name__}, not a torch.nn.Module; "
            "return the model instance"
        )

    # A factory may carry its own inputs (``build_big.example_inputs = ...``): a file with
    # several models of different sizes gives each one a realistic micro-batch.
    make_inputs = getattr(build, "example_inputs", None)
    if not callable(make_inputs):
        make_inputs = _find_function(module, path, "example_inputs", "returning a tuple or a dict")
    args, kwargs = _as_args_kwargs(_call(make_inputs, path, "example_inputs"), path)

    loss_fn = getattr(module, "loss_fn", None)
    make_target = getattr(build, "example_target", None)
    if not callable(make_target):
        make_target = getattr(module, "example_target", None)
    target = _call(make_target, path, "example_target") if callable(make_target) else None
    make_dims = getattr(build, "batch_dims", None)
    if not callable(make_dims):
        make_dims = getattr(module, "batch_dims", None)
    batch_dims = _call(make_dims, path, "batch_dims") if callable(make_dims) else None
    return ModelSource(
        batch_dims=batch_dims,
        path=path,
        factory=factory,
        model=model,
        args=args,
        kwargs=kwargs,
        loss_fn=loss_fn if callable(loss_fn) else None,
        target=target,
    )


# What stops fxpipe itself while a model file runs: Ctrl-C, and SIGINT or SIGTERM under the
# CLI. Any other BaseException the file raises (``class Stop(BaseException)``,
# GeneratorExit) is the file's error, worded like an Exception.
_STOPS = (KeyboardInterrupt, Interrupted)


def _import_file(path: Path) -> types.ModuleType:
    name = f"fxpipe_user_{path.stem}_{abs(hash(path.resolve())) % 10**8}"
    try:
        return import_file(path, name)
    except SyntaxError as exc:
        raise ModelFileError(
            f"{path}:{exc.lineno}: syntax error: {exc.msg}; fix the file and run again"
        ) from None
    except NotPythonError as exc:
        raise ModelFileError(str(exc)) from None
    except SystemExit as exc:
        raise ModelFileError(
            f"{_where(path, exc)}: the file called sys.exit({exc.code!r}) while fxpipe "
            "imported it; put the script part under if __name__ == \"__main__\""
        ) from None
    except BaseException as exc:  # the file's own BaseException subclasses too
        if isinstance(exc, _STOPS):
            raise
        raise ModelFileError(
            f"{_where(path, exc)}: importing the file raised {_one_line(exc)}; fix the file "
            "and run again"
        ) from None


def _find_function(
    module: types.ModuleType, path: Path, name: str, returns: str, *, named_by_user: bool = False
) -> Callable[[], Any]:
    function = getattr(module, name, None)
    if callable(function):
        return function
    if named_by_user:
        raise ModelFileError(f"{path}: no function {name}(); check the name after the ':'")
    hint = " or name another factory with FILE.py:NAME" if name == "build_model" else ""
    raise ModelFileError(f"{path}: no function {name}(); define {name}() {returns}{hint}")


def _call(function: Callable[[], Any], path: Path, name: str) -> Any:
    try:
        return function()
    except SystemExit as exc:
        raise ModelFileError(
            f"{_where(path, exc)}: {name}() called sys.exit({exc.code!r}); return instead "
            "of exiting"
        ) from None
    except BaseException as exc:  # the file's own BaseException subclasses too
        if isinstance(exc, _STOPS):
            raise
        raise ModelFileError(
            f"{_where(path, exc)}: {name}() raised {_one_line(exc)}; fix {name}() and run again"
        ) from None


def _as_args_kwargs(inputs: Any, path: Path) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    raise ModelFileError(
        f"{path}: example_inputs() returned {type(inputs).__name__}; return a tuple of "
        "positional inputs or a dict of keyword inputs for one micro-batch"
    )


def _where(path: Path, exc: BaseException) -> str:
    """``path:line`` of the innermost frame inside the user's file, along the exception chain."""
    line = None
    resolved = path.resolve()
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen and line is None:
        seen.add(id(chain))
        for frame in traceback.extract_tb(chain.__traceback__):
            if Path(frame.filename).resolve() == resolved:
                line = frame.lineno
        chain = chain.__cause__ or chain.__context__
    return f"{path}:{line}" if line else str(path)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 200:
        first = first[:197] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# ---------------------------------------------------------------------------- tracing


def trace(
    model: torch.nn.Module, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
    *, batch_dims: Any = None, autocast: torch.dtype | None = None,
) -> Traced:
    """Trace ``model`` on one micro-batch: symbolic_trace, else torch.export non-strict;
    and decide which inputs are batched (see batching.py; ``batch_dims`` is what the
    model file's ``batch_dims()`` returned). ``autocast``: the dtype the model trains
    under autocast at, traced under it (the module docstring)."""
    kwargs = dict(kwargs or {})
    device = _model_device(model)
    if _on_meta(device):
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    with _autocast(device, autocast), applied_functions() as calls, \
            tensor_hooks() as hook_sites, plain_calls() as regions:
        traced = _trace(model, args, kwargs, autocast, batch_dims)  # flat inputs: these
    # what the trace kept otherwise than the model runs it, or could not keep
    run_through = [f for f in calls.functions if f not in kept(traced.gm)]
    grad_mode_set = [f for f in run_through if f in calls.grad_mode]
    if grad_mode_set:
        raise TraceError(refusal(grad_mode_set))
    notes = [describe(run_through)] if run_through else []
    notes += dropped(model, traced.gm, hook_sites)
    attention = describe_attention(traced.gm)
    notes += [attention] if attention else []
    notes += [describe_checkpoints(len(regions))] if regions else []
    if autocast is not None and traced.tracer == "export" and _on_meta(device):
        notes.append(
            f"traced on the meta device, where autocast does not run: where the model "
            f"picks a dtype from a value autocast would make {_dtype_name(autocast)} (a "
            f"norm casting back to its input's dtype), the stages keep float32; build "
            f"the model on the CPU to trace it as autocast runs it")
    traced = replace(traced, notes=(*traced.notes, *notes))
    decision = decide_batching(model, args, kwargs, batch_dims)
    batched = tuple(
        any(id(t) in decision.batched for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor))
        for value in traced.flat_inputs
    )
    return replace(traced, batched=batched, batching=decision.how, model=model)


def _autocast(device: torch.device | None, dtype: torch.dtype | None
              ) -> contextlib.AbstractContextManager[object]:
    """Autocast at ``dtype`` on the model's device, where autocast runs (the CPU, CUDA);
    nothing for ``dtype`` None or a model on the meta device."""
    device_type = device.type if device is not None else "cpu"
    if dtype is None or not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _on_meta(device: torch.device | None) -> bool:
    return device is not None and device.type == "meta"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _trace(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
    autocast: torch.dtype | None, batch_dims: Any = None,
) -> Traced:
    """symbolic_trace (``fxpipe.tracing.symbolic``), else torch.export
    (``fxpipe.tracing.export``, with attention called as the model calls it eagerly:
    ``fxpipe.tracing.attention``); a ``TraceError`` that says why when neither captures
    it."""
    kwargs = dict(kwargs or {})
    notes: list[str] = []
    device = _model_device(model)
    if _on_meta(device):
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
        notes.append("set config.use_cache = False: a training step keeps no key/value cache")
    notes += _batch_norm_notes(model)

    try:
        gm, flat, inputs = symbolic_graph(model, args, kwargs)
    except Exception as exc:
        reason = _one_line(exc)
        symbolic_error = exc
    else:
        # Repeated layers are named for the passes not to run them again, by
        # symbolic_graph; where that failed (nothing named), again here, outside the try:
        # a fault there is fxpipe's, not a reason to export instead.
        if not any(meta.COPY_OF.has(node) for node in gm.graph.nodes):
            mark_copies(gm, model)
        return Traced(gm, "symbolic_trace", None, flat, tuple(notes), inputs)

    layered = export_in_layers(model, args, kwargs)
    if layered is not None:
        gm, flat, inputs, fixed_shapes, note = layered
        notes.append(note)
    else:
        try:
            program, fixed_shapes = export_program(model, args, kwargs, batch_dims=batch_dims)
        except Exception as exc:
            error = _untraceable(model, args, kwargs, reason, exc, symbolic_error)
            raise error from error.__cause__  # the failure that locates the model's line
        gm, flat, inputs = exported_graph(program, args, kwargs)
    sized = data_sized(gm)
    if sized is not None:
        raise TraceError(
            f"{type(model).__name__} makes a tensor whose size depends on the data "
            f"({sized}), and fxpipe sizes every op from the input sizes alone; give each "
            "tensor a size that follows from the input sizes (a mask or a fixed top-k "
            "rather than indexing by a condition; transformers 5 routes a mixture of "
            "experts so)"
        )
    attention_calls(gm, autocast)
    if fixed_shapes is not None:
        notes.append(
            f"torch.export could not keep input sizes symbolic ({_one_line(fixed_shapes)}); "
            "the stages accept the example's shapes only"
        )
    return Traced(gm, "export", reason, flat, tuple(notes), inputs)


def _untraceable(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str,
    export_error: Exception, symbolic_error: Exception,
) -> TraceError:
    """The error when both tracers fail: the inputs do not fit the model (it fails when run
    on them), or forward defeats both tracers. Export's failure comes first: the fix the
    error names follows from it, and symbolic_trace's can be far from the cause (on
    transformers' models, its own ``co_varnames is too small``)."""
    failed = _eager_failure(model, args, kwargs)
    if failed is not None:  # not a tracing problem: the inputs do not fit the model
        error = TraceError(
            f"{type(model).__name__} raised {_one_line(failed)} when run on the example "
            "inputs; make example_inputs() return what forward expects for one "
            "micro-batch (the number, shapes and dtypes of its arguments)"
        )
        error.__cause__ = failed
        return error
    error = TraceError(
        f"cannot trace {type(model).__name__}: torch.export failed "
        f"({_one_line(export_error)}) and so did symbolic_trace ({reason}); "
        f"{export_advice(export_error)}"
    )
    # Their tracebacks locate the failing line of the model file.
    error.__cause__ = export_error
    error.__context__ = symbolic_error
    return error


def _library_line(model_file: Path, exc: BaseException | None) -> str:
    """' (at FILE:LINE, `code`)': where ``exc`` was raised, the innermost line of its
    traceback outside torch, fxpipe and the standard library, when that is not in the model
    file (whose line the error starts with) but in a library it calls (transformers'
    modeling code, say); '' otherwise."""
    if exc is None:
        return ""
    outside = (str(Path(torch.__file__).parent), str(Path(__file__).parent),
               sysconfig.get_paths()["stdlib"], "<")
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(outside)]
    if not frames or Path(frames[-1].filename).resolve() == model_file.resolve():
        return ""
    code = f", `{frames[-1].line.strip()}`" if frames[-1].line else ""
    return f" (at {frames[-1].filename}:{frames[-1].lineno}{code})"


def _eager_failure(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Exception | None:
    """What running the model itself on the example inputs raises, if anything: when both
    tracers fail, this tells a model that cannot run on them from one they cannot capture."""
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as exc:
        return exc
    return None


def _batch_norm_notes(model: torch.nn.Module) -> list[str]:
    """What a pipeline changes for batch normalization in training mode: its statistics."""
    names = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if not names:
        return []
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return [
        f"batch normalization in training mode ({shown}): batch statistics are per "
        "micro-batch, as in GPipe, so outputs and gradients equal the unsplit model run "
        "micro-batch by micro-batch; running statistics are updated once per micro-batch, "
        "with or without recompute"
    ]


def trace_source(source: ModelSource, *, autocast: torch.dtype | None = None) -> Traced:
    """``trace`` for a loaded model; a trace error names the model file and line (a model
    built in memory, ``fxpipe.split``'s, has no file to name)."""
    try:
        return trace(source.model, source.args, source.kwargs, batch_dims=source.batch_dims,
                     autocast=autocast)
    except TraceError as exc:
        if not source.path.is_file():
            raise
        where = str(source.path)
        for cause in (exc.__cause__, exc.__context__):
            if cause is not None and _where(source.path, cause) != where:
                where = _where(source.path, cause)
                break
        raise TraceError(f"{where}: {exc}{_library_line(source.path, exc.__cause__)}") from None


def _model_device(model: torch.nn.Module) -> torch.device | None:
    for _, tensor in named_state(model):
        return tensor.device
    return None

