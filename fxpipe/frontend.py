"""Load the user's model file and trace the model into an FX graph.

The model file contract (docs/design.md): the file defines ``build_model()`` and
``example_inputs()`` (one micro-batch, a tuple of positional inputs or a dict
of keyword inputs), optionally ``loss_fn(output, target)`` and
``example_target()``. ``path.py:make_gpt`` names another factory.

Tracing tries ``torch.fx.symbolic_trace`` first (it keeps ``call_module``
nodes, which read best in generated code) and falls back to
``torch.export.export(..., strict=False)``, which captures Hugging Face models.

Training does not feed one shape forever (the last batch of an epoch is smaller,
collators pad to the longest sequence), so the graph must compute sizes from its
inputs. ``symbolic_trace`` keeps sizes symbolic by itself; ``torch.export`` is
asked to with ``Dim.AUTO`` on every dimension of every input, and keeps symbolic
the ones the model lets vary. Either way ``Traced.inputs`` records, per graph
input, the traced shape and which dimensions are free (``InputShape``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo

from fxpipe.batching import decide_batching
from fxpipe.metadevice import MetaRunner, named_state
from fxpipe.runtime.loading import NotPythonError, import_file

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


class TraceError(ValueError):
    """Neither tracer could capture the model."""


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


@dataclass(frozen=True)
class InputShape:
    """The shape one graph input was traced at, and which of its dimensions may vary.

    ``dynamic[i]`` is the range ``(low, high)`` assumed for dimension i (``high`` None:
    unbounded), or None where the graph holds the traced size as a constant.
    """

    name: str  # the graph placeholder's name
    shape: tuple[int, ...]
    dynamic: tuple[tuple[int, int | None] | None, ...]


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
    except Exception as exc:
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
    except Exception as exc:
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
    *, batch_dims: Any = None,
) -> Traced:
    """Trace ``model`` on one micro-batch: symbolic_trace, else torch.export non-strict;
    and decide which inputs are batched (see batching.py; ``batch_dims`` is what the
    model file's ``batch_dims()`` returned)."""
    kwargs = dict(kwargs or {})
    device = _model_device(model)
    if device is not None and device.type == "meta":
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    traced = _trace(model, args, kwargs)  # its flat inputs are these very tensors
    decision = decide_batching(model, args, kwargs, batch_dims)
    batched = tuple(
        any(id(t) in decision.batched for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor))
        for value in traced.flat_inputs
    )
    return replace(traced, batched=batched, batching=decision.how)


def _trace(
    model: torch.nn.Module, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
) -> Traced:
    kwargs = dict(kwargs or {})
    notes: list[str] = []
    device = _model_device(model)
    if device is not None and device.type == "meta":
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
        notes.append("set config.use_cache = False: a training step keeps no key/value cache")
    notes += _batch_norm_notes(model)

    try:
        with _grad_regions() as entered:
            gm = torch.fx.symbolic_trace(model)
        if entered:
            raise GradRegionError(
                f"forward enters {entered[0]}, which symbolic_trace does not record"
            )
        flat = _symbolic_inputs(model, gm, args, kwargs)
        _check_runs(gm, flat)
        inputs = _probe_dynamic(gm, flat)
        return Traced(gm, "symbolic_trace", None, flat, tuple(notes), inputs)
    except Exception as exc:
        reason = _one_line(exc)
        symbolic_error = exc

    try:
        program, note = _export(model, args, kwargs)
    except Exception as exc:
        failed = _eager_failure(model, args, kwargs)
        if failed is not None:  # not a tracing problem: the inputs do not fit the model
            error = TraceError(
                f"{type(model).__name__} raised {_one_line(failed)} when run on the example "
                "inputs; make example_inputs() return what forward expects for one "
                "micro-batch (the number, shapes and dtypes of its arguments)"
            )
            error.__cause__ = failed
            raise error from None
        error = TraceError(
            f"cannot trace {type(model).__name__}: symbolic_trace failed ({reason}) and "
            f"torch.export failed ({_one_line(exc)}); make forward free of data-dependent "
            "Python control flow"
        )
        # Their tracebacks locate the failing line of the model file.
        error.__cause__ = exc
        error.__context__ = symbolic_error
        raise error from None
    if note:
        notes.append(note)
    gm = program.module()
    assert isinstance(gm, torch.fx.GraphModule)
    _drop_export_checks(gm)
    _inline_lifted_constants(gm)
    flat = tuple(pytree.tree_leaves((args, kwargs)))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(flat) == len(placeholders), (len(flat), len(placeholders))
    inputs = _exported_shapes(program, placeholders, flat)
    return Traced(gm, "export", reason, flat, tuple(notes), inputs)


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


class GradRegionError(RuntimeError):
    """symbolic_trace ran through a grad-mode or autocast region it cannot record."""


_REGIONS = (
    (torch.autograd.grad_mode.no_grad, "__enter__", "torch.no_grad()"),
    (torch.autograd.grad_mode.enable_grad, "__enter__", "torch.enable_grad()"),
    (torch.autograd.grad_mode.set_grad_enabled, "__init__", "torch.set_grad_enabled()"),
    (torch.autograd.grad_mode.inference_mode, "__enter__", "torch.inference_mode()"),
    (torch.amp.autocast_mode.autocast, "__enter__", "torch.autocast()"),
)


@contextmanager
def _grad_regions() -> Iterator[list[str]]:
    """Note every grad-mode or autocast region entered (the stage would run it with
    autograd on, in full precision: torch.export records these regions, so the caller
    falls back to it)."""
    entered: list[str] = []
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in _REGIONS]

    def noting(original: Callable[..., Any], what: str) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            entered.append(what)
            return original(*args, **kwargs)
        return method

    for (cls, name, original), (_, _, what) in zip(saved, _REGIONS, strict=True):
        setattr(cls, name, noting(original, what))
    try:
        yield entered
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence stderr: Python's ``sys.stderr`` and file descriptor 2 (torch's C++ side)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def trace_source(source: ModelSource) -> Traced:
    """``trace`` for a loaded model file; a trace error names the file and line."""
    try:
        return trace(source.model, source.args, source.kwargs, batch_dims=source.batch_dims)
    except TraceError as exc:
        where = str(source.path)
        for cause in (exc.__cause__, exc.__context__):
            if cause is not None and _where(source.path, cause) != where:
                where = _where(source.path, cause)
                break
        raise TraceError(f"{where}: {exc}") from None


def _drop_export_checks(gm: torch.fx.GraphModule) -> None:
    """Remove export's input guards, dtype assertions and unread attributes."""
    for node in reversed(gm.graph.nodes):
        guard = node.op == "call_module" and node.target == "_guards_fn"
        check = (
            node.op == "call_function"
            and node.target is torch.ops.aten._assert_tensor_metadata.default
        )
        if (guard or check) and not node.users:
            gm.graph.erase_node(node)
            if guard:
                gm.delete_submodule("_guards_fn")
    # A tied parameter appears once per name; only the one export reads has users.
    gm.graph.eliminate_dead_code(is_impure_node=_updates_state)
    gm.recompile()


# Ops that update running statistics in place though their schemas say nothing of it
# (args[3:5]: running_mean, running_var; args[5]: training / use_input_stats).
_RUNNING_STATS = (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default)


def _updates_state(node: torch.fx.Node) -> bool:
    """Whether dead code elimination must keep ``node``: an op with side effects, such as a
    BatchNorm in training mode whose output nothing reads (its running statistics still
    change, as in the model)."""
    if node.is_impure():
        return True
    return (node.op == "call_function" and node.target in _RUNNING_STATS
            and len(node.args) > 5 and node.args[5] is True
            and any(a is not None for a in node.args[3:5]))


_LIFTED_LIMIT = 64  # elements: a constant up to this size reads well as a literal


def _inline_lifted_constants(gm: torch.fx.GraphModule) -> None:
    """Tensors that forward creates from Python values (``torch.tensor([-2])``) are
    lifted by export into attributes that are neither parameters nor buffers, which
    no stage can bind from the model. Each read becomes the op that makes the
    tensor, ``torch.tensor(values, dtype=..., device=...)``, an ordinary op of the
    stage that reads it (the code generator moves ``device`` to the stage's);
    export's ``lift_fresh_copy`` of it, a copy of a fresh tensor, goes with it."""
    state = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    state |= {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or str(node.target) in state:
            continue
        owner, _, leaf = str(node.target).rpartition(".")
        value = getattr(gm.get_submodule(owner), leaf)
        if not isinstance(value, torch.Tensor):
            continue
        if value.is_meta or value.numel() > _LIFTED_LIMIT:
            raise TraceError(
                f"torch.export lifted a constant tensor {node.target} of shape "
                f"{tuple(value.shape)} that forward creates; fxpipe writes such constants "
                f"as literals up to {_LIFTED_LIMIT} elements: register it as a buffer "
                "(self.register_buffer) in __init__ instead"
            )
        with gm.graph.inserting_before(node):
            literal = gm.graph.call_function(
                torch.tensor, (value.tolist(),), {"dtype": value.dtype, "device": value.device}
            )
        literal.meta = dict(node.meta)
        for user in list(node.users):
            if user.target is torch.ops.aten.lift_fresh_copy.default:
                user.replace_all_uses_with(literal)
                gm.graph.erase_node(user)
        node.replace_all_uses_with(literal)
        gm.graph.erase_node(node)
        delattr(gm.get_submodule(owner), leaf)
    gm.recompile()


def _export(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.export.ExportedProgram, str | None]:
    """``torch.export`` non-strict with every input dimension free (``Dim.AUTO``): export
    keeps symbolic each dimension the model lets vary and specializes the others.

    torch.export specializes a dimension of size 1 (its 0/1 rule), so an example batch
    of one sample is traced as two (every leaf's dim 0 repeated); the costs are still
    taken at the example's own shapes. A model that cannot be exported with free
    dimensions is exported at the example's shapes, and the returned note says so.
    """
    attempts = [_widened(args, kwargs)] if _batch_of_one(args, kwargs) else []
    attempts.append((args, kwargs))
    for trace_args, trace_kwargs in attempts:
        try:
            with _quiet_stderr():  # a failing export dumps its partial graph on stderr
                program = torch.export.export(
                    model,
                    trace_args,
                    trace_kwargs,
                    dynamic_shapes=_all_dims_auto(model, trace_args, trace_kwargs),
                    strict=False,
                )
            return program, None
        except Exception as exc:
            reason = _one_line(exc)
    with _quiet_stderr():
        program = torch.export.export(model, args, kwargs, strict=False)
    return program, (
        f"torch.export could not keep input sizes symbolic ({reason}); the stages accept "
        "the example's shapes only"
    )


def _all_dims_auto(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``dynamic_shapes`` for export: ``Dim.AUTO`` on every dimension of every tensor."""

    def auto(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {d: torch.export.Dim.AUTO for d in range(value.dim())} or None
        return None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {
        name: pytree.tree_map(auto, value, is_leaf=lambda v: isinstance(v, torch.Tensor))
        for name, value in bound.arguments.items()
    }


def _batch_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [
        x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() > 0
    ]


def _batch_of_one(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    leaves = _batch_leaves(args, kwargs)
    return bool(leaves) and all(x.size(0) == 1 for x in leaves)


def _widened(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example with every batched leaf's single sample repeated: a batch of two."""
    widened = pytree.tree_map_only(
        torch.Tensor, lambda x: torch.cat([x, x]) if x.dim() > 0 else x, (args, kwargs)
    )
    return widened[0], widened[1]


def _exported_shapes(
    program: torch.export.ExportedProgram,
    placeholders: list[torch.fx.Node],
    flat: tuple[Any, ...],
) -> tuple[InputShape, ...]:
    """Each tensor input's traced shape and the range export assumed for its free dims.

    The lower bound is lowered to the example's size where export's 0/1 rule excluded
    it (a batch of one traced as two): the graph computes the same at that size.
    """
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user_inputs = program.graph_signature.user_inputs
    assert len(user_inputs) == len(placeholders), (user_inputs, placeholders)
    shapes = []
    for node, user_input, value in zip(placeholders, user_inputs, flat, strict=True):
        fake = by_name[str(user_input)].meta.get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(fake, torch.Tensor):
            continue
        dynamic: list[tuple[int, int | None] | None] = []
        for size, traced in zip(value.shape, fake.shape, strict=True):
            if isinstance(traced, int) or traced.node.expr.is_number:
                dynamic.append(None)
                continue
            bounds = program.range_constraints.get(traced.node.expr)
            low = int(bounds.lower) if bounds is not None else 1
            high = bounds.upper if bounds is not None else None
            high_int = int(high) if high is not None and high != int_oo else None
            dynamic.append((min(low, int(size)), high_int))
        shapes.append(InputShape(node.name, tuple(value.shape), tuple(dynamic)))
    return tuple(shapes)


def _model_device(model: torch.nn.Module) -> torch.device | None:
    for _, tensor in named_state(model):
        return tensor.device
    return None


def _symbolic_inputs(
    model: torch.nn.Module, gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """The example inputs in the order of the traced graph's placeholders."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    flat = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = str(node.target)
        if name.startswith("*"):
            raise TypeError(f"forward takes {name}, which symbolic_trace cannot bind")
        flat.append(bound.arguments[name])
    return tuple(flat)


def _check_runs(gm: torch.fx.GraphModule, flat: tuple[Any, ...]) -> None:
    """Run the graph once on meta tensors: symbolic_trace can succeed on a graph that fails."""
    MetaRunner(gm).run_on_meta(*flat)


def _probe_dynamic(gm: torch.fx.GraphModule, flat: tuple[Any, ...]) -> tuple[InputShape, ...]:
    """Which input dimensions a symbolic_trace graph lets vary, learnt by running it on meta
    tensors with each dimension doubled (every input that has that size at that index
    together, so inputs that must agree, like ids and their mask, still do)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [(i, x) for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    # (dim index, size) -> the range assumed: unbounded where twice the size runs, up to
    # the traced size where only half of it does (a model with a maximum length)
    free: dict[tuple[int, int], tuple[int, int | None]] = {}
    for key in sorted({(d, size) for _, x in tensors for d, size in enumerate(x.shape)}):
        d, size = key
        if _runs_resized(gm, flat, tensors, d, size, 2 * size):
            free[key] = (1, None)
        elif size > 1 and _runs_resized(gm, flat, tensors, d, size, size // 2):
            free[key] = (1, size)
    return tuple(
        InputShape(
            placeholders[i].name,
            tuple(x.shape),
            tuple(free.get((d, size)) for d, size in enumerate(x.shape)),
        )
        for i, x in tensors
    )


def _runs_resized(
    gm: torch.fx.GraphModule,
    flat: tuple[Any, ...],
    tensors: list[tuple[int, torch.Tensor]],
    dim: int,
    size: int,
    new_size: int,
) -> bool:
    probe = list(flat)
    for i, x in tensors:
        if x.dim() > dim and x.size(dim) == size:
            shape = list(x.shape)
            shape[dim] = new_size
            probe[i] = torch.empty(shape, dtype=x.dtype, device="meta")
    try:
        MetaRunner(gm).run_on_meta(*probe)
    except Exception:
        return False
    return True
