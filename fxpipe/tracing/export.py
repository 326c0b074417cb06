"""Tracing with ``torch.export.export(..., strict=False)``, the fallback that captures
Hugging Face models whose Python control flow defeats ``symbolic_trace``.

Export is asked to keep every input dimension symbolic (``Dim.AUTO``) and keeps the ones
the model lets vary. Its graph is then made one fxpipe can cut: export's input guards and
dtype assertions removed, so are the slices of a whole tensor that eager indexing skips,
the constants it lifts out of forward turned back into ops, each call of the model's own
``torch.autograd.Function`` kept as one call (``functions.py``), and the range it
assumed for each free dimension read off the program. transformers 4.x's attention masks,
which it builds with ``torch.vmap``, are exported as broadcasts (``_masks_broadcast``),
and torch.nn's transformer stacks detect no causal mask by its values
(``_causal_undetected``).
An export with free dimensions that fails leaves no marks on the inputs (``_unmarked``),
so the export at fixed shapes that follows sees them as they were. A graph that makes a
tensor whose size depends on the data is refused, with where (``data_sized``).
(The frontend then has attention called as the model calls it eagerly: ``attention.py``.)
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo

from fxpipe.tracing.functions import applied_calls, exported_functions
from fxpipe.tracing.records import InputShape, TraceError

__all__ = ["advice", "data_sized", "export_program", "exported_graph", "quiet_stderr",
           "running_stats"]


def export_program(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
    batch_dims: Any = None,
) -> tuple[torch.export.ExportedProgram, Exception | None]:
    """``torch.export`` non-strict with every input dimension free (``Dim.AUTO``): export
    keeps symbolic each dimension the model lets vary and specializes the others.

    torch.export specializes a dimension of size 1 (its 0/1 rule), so an example batch
    of one sample is traced as two (every leaf's dim 0 repeated, but the arguments
    ``batch_dims`` declares shared: a (1, T) table of positions repeated would pass for
    batched, and export, seeing it added to the batch, would read the batch size off it);
    the costs are still taken at the example's own shapes. A model that cannot be exported with free
    dimensions is exported at the example's shapes, and the error that stopped the
    export with free dimensions is returned with it (None when it did not fail).
    """
    whole = _declared_whole(batch_dims, len(args))
    attempts = [_widened(args, kwargs, whole)] if _batch_of_one(args, kwargs, whole) else []
    attempts.append((args, kwargs))
    for trace_args, trace_kwargs in attempts:
        try:
            dims = _all_dims_auto(model, trace_args, trace_kwargs)
            with _unmarked(trace_args, trace_kwargs):
                return _export(model, trace_args, trace_kwargs, dims), None
        except Exception as exc:
            failure = exc
    return _export(model, args, kwargs, None), failure


@contextmanager
def _unmarked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Take off the input tensors what an export with free dimensions marked on them. One
    that fails leaves its marks (``_dynamo_weak_dynamic_indices`` and others, torch 2.13),
    and the next export of the same tensors, at fixed shapes too, traced them symbolic
    again: transformers 4.57's Falcon, OLMoE and Nemotron then failed where a symbolic
    bool reached ``scaled_dot_product_attention``."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    had = [set(vars(t)) for t in tensors]
    try:
        yield
    finally:
        for tensor, names in zip(tensors, had, strict=True):
            for name in set(vars(tensor)) - names:
                delattr(tensor, name)


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            dynamic_shapes: dict[str, Any] | None) -> torch.export.ExportedProgram:
    """One ``torch.export`` non-strict, keeping the model's own autograd.Functions as one
    call each (``functions.py``); where that fails (a Function called where export
    cannot hold such a call, inside an autocast region), exported again running through
    them, which the frontend names in a note."""
    try:
        # a failing export dumps its partial graph on stderr
        with quiet_stderr(), _uncached(), _masks_broadcast(), _causal_undetected(), \
                exported_functions() as recorded:
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes,
                                       strict=False)
    except Exception:
        if not recorded:
            raise
    with quiet_stderr(), _uncached(), _masks_broadcast(), _causal_undetected():
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes,
                                   strict=False)


def advice(error: BaseException) -> str:
    """What to change in forward so that torch.export captures it, by what stopped it."""
    text = str(error)
    if "fake tensor in the exported program constant" in text:
        # torch names the tensor: "... refer to following model attribute: lin.lifted_tensor_0"
        found = re.search(r"model attribute: (\S+?)\.?(?:\s|$)", text)
        owner = found.group(1).rpartition(".")[0] if found else ""
        where = f" (in {owner})" if owner else ""
        return (f"make forward leave the model's tensors as they are: it changes one in "
                f"place through .data or keeps a tensor it made{where}, which torch.export "
                f"cannot capture")
    if "Couldn't swap" in text:
        return ("make forward leave the model's modules as they are: it moves or casts one "
                "(module.to(...)), which torch.export cannot capture")
    if "data-dependent" in text or "DataDependent" in type(error).__name__:
        return "make forward free of data-dependent Python control flow"
    if ".numpy()" in text or "data pointer" in text or "tolist" in text:
        return ("make forward free of data-dependent Python code: it reads a tensor's values "
                "out of torch (.numpy(), .tolist()), which torch.export cannot trace")
    return ("make forward run under torch.export, which may take other branches than an "
            "eager run (torch.compiler.is_compiling() is true there)")


def _uncached() -> contextlib.AbstractContextManager[object]:
    """Export without the fake-tensor cache. With free dimensions a cache hit costs more
    than the op it saves: the output is rebuilt from the entry with symbolic sizes, its
    strides worked out again in Python (935 hits, 2.6 s of a 3.4 s export of
    transformers' Llama-3-8B cut to two layers, torch 2.13). Without it that export takes
    2.1 s instead of 3.1 (medians of 4), and gives the same ops in the same order (named
    otherwise: some names' counters advance differently)."""
    config = torch._dynamo.config
    if not hasattr(config, "fake_tensor_cache_enabled"):  # an older torch, no cache
        return contextlib.nullcontext()
    return config.patch(fake_tensor_cache_enabled=False)


@contextmanager
def _causal_undetected() -> Iterator[None]:
    """torch.nn's ``TransformerEncoder`` and ``TransformerDecoder``, given a mask and no
    ``is_causal``, compare the mask with a causal one to pass the layers a hint, a branch
    on data that export cannot take. The hint changes no result (the mask is applied
    either way), so while exporting none is detected; the frontend then gives back
    ``is_causal=True`` for a mask of the sizes alone that is causal (``attention.py``),
    as the hint would have."""
    transformer = torch.nn.modules.transformer
    detect = transformer._detect_is_causal_mask

    def hinted_only(mask: Any, is_causal: bool | None = None, size: Any = None) -> bool:
        return is_causal is True

    transformer._detect_is_causal_mask = hinted_only
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


@contextmanager
def _masks_broadcast() -> Iterator[None]:
    """transformers 4.x builds its attention masks with ``torch.vmap`` over the batch, head,
    query and key indices; export keeps that as functorch batching ops, which neither the
    analysis nor a stage module can run. Its mask functions compare and index tensors
    elementwise, so the same mask is the function called once on the indices broadcast
    against each other, which is what transformers 5 does: while exporting, 4.x's vmap
    helper is replaced by that."""
    masking = sys.modules.get("transformers.masking_utils")
    vmapped = getattr(masking, "_vmap_for_bhqkv", None)
    if vmapped is None:
        yield
        return
    masking._vmap_for_bhqkv = _broadcast_for_bhqkv  # type: ignore[union-attr]
    try:
        yield
    finally:
        masking._vmap_for_bhqkv = vmapped  # type: ignore[union-attr]


def _broadcast_for_bhqkv(mask_function: Any, bh_indices: bool = True) -> Any:
    """transformers 4.x's ``_vmap_for_bhqkv`` by broadcasting: a (batch, heads, queries,
    keys) mask, or (queries, keys) without batch and head indices."""

    def mask(batch_idx: Any, head_idx: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor
             ) -> torch.Tensor:
        if not bh_indices:
            out = mask_function(batch_idx, head_idx, q_idx[:, None], kv_idx[None, :])
            return out.expand(q_idx.shape[0], kv_idx.shape[0]).contiguous()
        out = mask_function(batch_idx[:, None, None, None], head_idx[None, :, None, None],
                            q_idx[None, None, :, None], kv_idx[None, None, None, :])
        shape = (batch_idx.shape[0], head_idx.shape[0], q_idx.shape[0], kv_idx.shape[0])
        return out.expand(shape).contiguous()

    return mask


def exported_graph(
    program: torch.export.ExportedProgram, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.fx.GraphModule, tuple[Any, ...], tuple[InputShape, ...]]:
    """The program's graph made one fxpipe can cut, the example inputs in placeholder order
    and the shape of each tensor input."""
    gm = program.module()
    assert isinstance(gm, torch.fx.GraphModule)
    _drop_export_checks(gm)
    applied_calls(gm)
    _drop_full_slices(gm)
    _inline_lifted_constants(gm)
    flat = tuple(pytree.tree_leaves((args, kwargs)))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(flat) == len(placeholders), (len(flat), len(placeholders))
    return gm, flat, _exported_shapes(program, placeholders, flat)


def data_sized(gm: torch.fx.GraphModule) -> str | None:
    """Where the exported ``gm`` first makes a tensor whose size depends on the data
    (indexing by a mask, ``nonzero``, a 4.x mixture of experts' routing): the op, its
    size and the innermost line of the model's source that called it; None when every
    size follows from the input sizes. Such a graph can be neither costed (every op is
    sized without data) nor cut into stages of known shapes."""
    for node in gm.graph.nodes:
        sized = [t for t in pytree.tree_leaves(node.meta.get("val"))
                 if isinstance(t, torch.Tensor) and free_unbacked_symbols(t)]
        if not sized:
            continue
        frames = [line.strip() for line in str(node.meta.get("stack_trace", "")).splitlines()
                  if line.strip()]
        where = ""
        if len(frames) >= 2 and frames[-2].startswith('File "'):
            path, _, rest = frames[-2].removeprefix('File "').partition('", line ')
            if Path(path).resolve().is_relative_to(Path.cwd()):
                path = os.path.relpath(path)
            where = f" at {path}:{rest.split(',')[0]}: {frames[-1]}"
        return f"{node.target} of size {tuple(sized[0].shape)}{where}"
    return None


@contextmanager
def quiet_stderr() -> Iterator[None]:
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


def _drop_export_checks(gm: torch.fx.GraphModule) -> None:
    """Remove export's input guards, dtype assertions and unread attributes.

    The assertions pin each value to the dtype it had when traced, in the bodies of
    higher-order ops too (a rotary embedding's no-grad region asserts its float32
    ``inv_freq`` before upcasting it): they would fail on the model as ``*-true`` runs it,
    cast with ``model.to(dtype)``, where the graph's own casts say what runs."""
    for node in reversed(gm.graph.nodes):
        guard = node.op == "call_module" and node.target == "_guards_fn"
        if (guard or _is_dtype_check(node)) and not node.users:
            gm.graph.erase_node(node)
            if guard:
                gm.delete_submodule("_guards_fn")
    # A tied parameter appears once per name; only the one export reads has users.
    gm.graph.eliminate_dead_code(is_impure_node=_updates_state)
    gm.recompile()
    for body in gm.modules():
        if body is not gm and isinstance(body, torch.fx.GraphModule):
            for node in reversed(body.graph.nodes):
                if _is_dtype_check(node) and not node.users:
                    body.graph.erase_node(node)
            body.recompile()


def _drop_full_slices(gm: torch.fx.GraphModule) -> None:
    """Read the tensor itself where export recorded a slice of all of it (``x[:, None]``
    traces as ``slice(x, 0, 0, 9223372036854775807)``). Eager indexing returns the tensor
    itself for such a slice and records nothing, so the stages now run what the model
    runs; a recorded one reads as noise in the stage code, and its backward copies the
    whole gradient into a new tensor."""
    for graph_module in gm.modules():
        if not isinstance(graph_module, torch.fx.GraphModule):
            continue
        for node in list(graph_module.graph.nodes):
            if _is_full_slice(node):
                node.replace_all_uses_with(node.args[0])
                graph_module.graph.erase_node(node)
        graph_module.recompile()


def _is_full_slice(node: torch.fx.Node) -> bool:
    if not (node.op == "call_function" and node.target is torch.ops.aten.slice.Tensor):
        return False
    names = ("self", "dim", "start", "end", "step")
    bound = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    return (bound.get("start") in (None, 0) and bound.get("end") in (None, sys.maxsize)
            and bound.get("step") in (None, 1) and isinstance(bound["self"], torch.fx.Node))


def _is_dtype_check(node: torch.fx.Node) -> bool:
    return (node.op == "call_function"
            and node.target is torch.ops.aten._assert_tensor_metadata.default)


# Ops that update running statistics in place though their schemas say nothing of it
# (args[3:5]: running_mean, running_var; args[5]: training / use_input_stats).
_RUNNING_STATS = (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default)


def running_stats(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The running statistics ``node`` updates in place though its schema says nothing of
    it (a BatchNorm or InstanceNorm in training mode); empty for any other node."""
    if not (node.op == "call_function" and node.target in _RUNNING_STATS
            and len(node.args) > 5 and node.args[5] is True):
        return []
    return [a for a in node.args[3:5] if isinstance(a, torch.fx.Node)]


def _updates_state(node: torch.fx.Node) -> bool:
    """Whether dead code elimination must keep ``node``: an op with side effects, such as a
    BatchNorm in training mode whose output nothing reads (its running statistics still
    change, as in the model)."""
    return node.is_impure() or bool(running_stats(node))


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


def _declared_whole(batch_dims: Any, num_args: int) -> frozenset[int | str]:
    """The positions and keywords the model file's ``batch_dims()`` declares shared (None:
    handed whole to every micro-batch)."""
    positional: Any = ()
    keyword: Any = {}
    if isinstance(batch_dims, dict):
        keyword = batch_dims
    elif (isinstance(batch_dims, tuple) and len(batch_dims) == 2
          and isinstance(batch_dims[0], (tuple, list)) and isinstance(batch_dims[1], dict)):
        positional, keyword = batch_dims  # both, as (tuple, dict)
    elif isinstance(batch_dims, (tuple, list)):
        positional = batch_dims
    return frozenset([*(i for i, dim in enumerate(positional[:num_args]) if dim is None),
                      *(name for name, dim in keyword.items() if dim is None)])


def _batched(args: tuple[Any, ...], kwargs: dict[str, Any], whole: frozenset[int | str]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments but those declared shared (left as they are)."""
    return (tuple(a for i, a in enumerate(args) if i not in whole),
            {k: v for k, v in kwargs.items() if k not in whole})


def _batch_of_one(args: tuple[Any, ...], kwargs: dict[str, Any],
                  whole: frozenset[int | str] = frozenset()) -> bool:
    leaves = _batch_leaves(*_batched(args, kwargs, whole))
    return bool(leaves) and all(x.size(0) == 1 for x in leaves)


def _widened(
    args: tuple[Any, ...], kwargs: dict[str, Any], whole: frozenset[int | str] = frozenset()
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example with every batched leaf's single sample repeated: a batch of two (the
    arguments in ``whole`` as they are)."""
    def two(value: Any) -> Any:
        return pytree.tree_map_only(
            torch.Tensor, lambda x: torch.cat([x, x]) if x.dim() > 0 else x, value)

    return (tuple(a if i in whole else two(a) for i, a in enumerate(args)),
            {k: v if k in whole else two(v) for k, v in kwargs.items()})


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
        if not isinstance(value, torch.Tensor):
            continue  # a constant input (export names it by its value): no shape
        fake = by_name[str(user_input)].meta.get("val")
        if not isinstance(fake, torch.Tensor):
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
