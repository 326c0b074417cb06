"""Random models for the fuzzer: a hypothesis strategy that draws a ``ModelSpec`` (plain
data) and ``build_model`` that turns it into an ``nn.Module``.

A spec is a DAG of ops over a pool of live tensors. Every tensor has a batch
dimension first and a per-sample shape after it; every op but BatchNorm in
training mode works per sample, so a mini-batch split into micro-batches along
dim 0 gives the unsplit model's outputs (with BatchNorm, or bfloat16 rounding in
an autocast region, the unsplit model run micro-batch by micro-batch: see
``per_microbatch``). Shared inputs have no batch dimension (a mask, position
ids): they sit outside the pool, after the batched inputs in ``forward``'s
signature, and every micro-batch reads them whole. The module's ``forward``
interprets the fixed op list built in ``__init__``, so ``symbolic_trace`` sees
ordinary module calls, functions and methods; an ``untraceable`` spec branches
on a tensor's size, which ``symbolic_trace`` rejects and ``torch.export``
specialises, to fuzz the export path too (so does any grad-mode or autocast
region, which symbolic_trace cannot record).

Every drawn spec with a ``mutate`` op runs forward and backward in eager mode
before it is returned (the in-place op may overwrite a value autograd saved: such
a model is no model, and is drawn again).

    spec = data.draw(model_specs())
    model = build_model(spec)                 # float64, weights seeded by spec.seed
    args = example_inputs(spec, batch=2, seed=0)

Op kinds (``Op.kind``) and their fields (``srcs`` are pool indices, the result
or results are appended to the pool):

    linear      Linear on the last dim (``module`` names it; a name reused is a
                shared submodule, ``tie`` ties its weight to another Linear's)
    embed       Embedding of an int64 token-id input (a Linear may tie its weight
                to it: a GPT LM head)
    conv1d/2d   Conv1d on (C, L) / Conv2d on (C, H, W), same padding
    norm        LayerNorm on the last dim / GroupNorm on dim 1 (``arg``: groups)
    act         relu / gelu / tanh, as a module, a function or a method
    add/mul     two tensors of one shape (``srcs``), or a tensor and a buffer (a
                buffer may be read by several ops)
    cat         two tensors along a dim, then a Linear back to the first width
                when the dim is the last one
    chunk       chunk / split along a dim into pieces (each joins the pool)
    reshape     (F,) -> (a, b), (a, b) -> (a*b,), (C, H, W) -> (C, H*W) by
                reshape / view / flatten
    permute     a permutation of the per-sample dims (+ the inverse when ``arg``)
    matmul      x @ y, x @ x.mT, or x @ a registered Parameter (maybe one that
                another matmul reads too)
    inplace     relu_ / add_ / mul_ / += on a fresh intermediate, or relu_ on a view of it
    where       torch.where(x > 0, x, y) (a bool mask between two ops)
    detach      x.detach() * 2 (no gradient flows back)
    function    ScaledGradient.apply(x, c), a torch.autograd.Function of this module: an
                identity whose own backward scales the gradient by c (-1: a gradient
                reversal layer), which only the Function's backward computes
    const       x + arange(size), x * ones_like(x).cumsum(-1), x - x.new_full(...)
    reduce      mean / sum / amax over a per-sample dim, keepdim or not
    scalar      x * c, x + c, softmax over the last dim
    branch      an untraceable branch on x.shape[-1] (export only)
    region      one op inside ``torch.no_grad()``, ``torch.set_grad_enabled(False)``,
                ``no_grad`` around ``enable_grad``, or ``torch.autocast("cpu",
                dtype=torch.bfloat16)`` (a float32 matmul run in bfloat16, float64 ops
                that autocast leaves alone, or autocast disabled inside it)
    mutate      mul_ / add_ / relu_ / add_(y) on a model input or on a value other ops
                already read; later ops read the result or the old name (``how``:
                "op:result" or "op:statement"), both the mutated tensor in eager mode
    shared      x + s, x * s, x.masked_fill(s > 0, 0) with a shared float input s
                of x's trailing dims (its first maybe 1), or x + Embedding(position
                ids) with shared int64 ids of shape (1, L)
    batchnorm   BatchNorm1d on (C,) / (C, L), BatchNorm2d on (C, H, W), momentum
                0.1 / 0.3 / None (cumulative), affine or not; the model may be in eval
                mode (``ModelSpec.train``)
    table       a value without a batch dimension and a batch count, made early and
                read later, as HF Llama's rotary table: from x of shape (L, F), the
                count ``x.size(0)`` and a table ``cos(arange(L) * w)`` of shape (1, L, F)
                or (1, L, 1) (``arg``: the Parameter w, of F or 1 elements); adds nothing
                to the pool. Traced at one row
                the table has dim 0 of the batch size, and a stage that took it for
                rows counted 1 whatever the rows
    rows        y of shape (L, F) and a table's count and table (``arg``: which table;
                ``srcs[1]``: the x it counted): ``y.unsqueeze(1).expand(count, 2, -1,
                -1).sum(1) * table`` or ``(y + table).reshape(count, -1, F)``; every
                table is read at least once
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

__all__ = ["ModelSpec", "Op", "ScaledGradient", "build_model", "example_inputs", "model_specs",
           "output_leaves", "runs_eagerly"]

Shape = tuple[int, ...]  # per-sample shape (the batch dimension excluded)


@dataclass(frozen=True)
class Op:
    kind: str
    srcs: tuple[int, ...]
    out: tuple[Shape, ...]  # the shapes this op adds to the pool, in order
    how: str = ""  # the variant (activation name, style, in-place op...)
    arg: Any = None  # kind-specific: widths, dims, groups, permutation, sizes
    module: str = ""  # the submodule it calls ("" for none)
    tie: str = ""  # linear: the module whose weight this one's weight is


@dataclass(frozen=True)
class ModelSpec:
    inputs: tuple[Shape, ...]
    ops: tuple[Op, ...]
    outputs: Any  # a tree (tuple/dict/int) of pool indices
    seed: int
    kwargs: bool = False  # feed the inputs by keyword
    untraceable: bool = False
    modules: dict[str, tuple[str, Any]] = field(default_factory=dict)  # name -> (kind, arg)
    buffers: dict[str, Shape] = field(default_factory=dict)
    params: dict[str, Shape] = field(default_factory=dict)
    ids: dict[int, int] = field(default_factory=dict)  # input index -> vocabulary (int64 ids)
    frozen: tuple[str, ...] = ()  # modules whose parameters do not require grad
    # inputs without a batch dimension, after ``inputs`` in forward's signature: the
    # whole shape and 0 for a float tensor, or the vocabulary for int64 position ids
    shared: tuple[tuple[Shape, int], ...] = ()
    train: bool = True  # training mode (BatchNorm normalizes with batch statistics)
    min_batch: int = 1  # samples per micro-batch BatchNorm needs (2 on one value per channel)

    @property
    def batchnorm(self) -> bool:
        return any(kind.startswith("batchnorm") for kind, _ in self.modules.values())

    @property
    def live_inputs(self) -> set[int]:
        """Indices (in forward's signature) of the inputs some output depends on, or the
        running statistics of a batch norm in training mode: whether another input is
        batched changes nothing the model returns or keeps (one only written in place,
        say), so nothing can tell."""
        first = len(self.inputs)
        live = set(output_leaves(self.outputs))
        shared: set[int] = set()
        made = first + sum(len(op.out) for op in self.ops)  # the pool's size
        for op in reversed(self.ops):
            made -= len(op.out)
            if (live & set(range(made, made + len(op.out)))
                    or (op.kind == "batchnorm" and self.train)):
                live.update(op.srcs)
                if op.kind == "shared":
                    shared.add(first + op.arg)
        return {i for i in live if i < first} | shared

    @property
    def reduced_precision(self) -> bool:
        """A matmul in bfloat16 or float32 (an autocast region): a bigger batch may sum
        each row in another order and round it differently."""
        return any(op.kind == "region" and op.how in ("autocast", "autocast_off")
                   for op in self.ops)

    @property
    def per_microbatch(self) -> bool:
        """The unsplit model's outputs depend on how the batch is cut: BatchNorm's batch
        statistics in training mode, rounding in reduced precision. The oracle is then the
        unsplit model run micro-batch by micro-batch."""
        return (self.batchnorm and self.train) or self.reduced_precision


WIDTHS = st.integers(4, 16)
MAX_SHARED = 2  # shared inputs per model


# ---------------------------------------------------------------------------- the strategy


@st.composite
def model_specs(draw: st.DrawFn, *, max_ops: int = 12, untraceable: bool | None = None,
                reuse: bool = True, table: bool | None = None) -> ModelSpec:
    """A random model: 1-3 inputs, 4-``max_ops`` ops, a tree of 1-4 outputs, that runs
    forward and backward in eager mode. ``reuse``: modules and parameters may be used by
    several ops (shared, tied); without it every parameter has one reader (PipeDream's
    weight stashing keeps a parameter on one stage, see ``PipedreamTieError``).
    ``table``: a table op right after the first Linear (None: in half the models)."""
    while True:
        spec = draw(_specs(max_ops=max_ops, untraceable=untraceable, reuse=reuse,
                           table=table))
        if not any(op.kind == "mutate" for op in spec.ops) or runs_eagerly(spec):
            return spec


def runs_eagerly(spec: ModelSpec) -> bool:
    """Whether the model runs forward and backward in eager mode (an in-place op may have
    overwritten a value autograd saved for the backward)."""
    model = build_model(spec)
    args, kwargs = example_inputs(spec, batch=max(2, spec.min_batch), seed=0)
    try:
        loss = _mean_of_leaves(model(*args, **kwargs))
        if loss.requires_grad:
            loss.backward()
    except RuntimeError as exc:
        if "modified by an inplace operation" in str(exc):
            return False
        raise
    return True


def _mean_of_leaves(output: Any) -> torch.Tensor:
    leaves = [leaf for leaf in output_leaves(output) if leaf.is_floating_point()]
    return sum((leaf.mean() for leaf in leaves), torch.zeros((), dtype=torch.float64))


@st.composite
def _specs(draw: st.DrawFn, *, max_ops: int, untraceable: bool | None, reuse: bool,
           table: bool | None = None) -> ModelSpec:
    builder = _Builder(draw, reuse=reuse)
    for i in range(draw(st.integers(1, 3))):
        builder.new_input(ids=bool(table) and i == 0)  # Llama's input_ids
    if draw(st.booleans()) if table is None else table:  # made first, read late: rotary
        builder.table(0)
    # Every model starts with a parameterised op, so some output needs a gradient.
    if 0 not in builder.ids:
        builder.linear(0, trainable=True)
    for i in sorted(builder.ids):
        builder.embed(i)
    for _ in range(draw(st.integers(min(3, max_ops - 1), max_ops - 1))):
        builder.random_op()
    for t in range(len(builder.tables)):
        if t not in builder.read or draw(st.booleans()):  # and by the last layer
            builder.rows(None, t)
    if untraceable is None:
        untraceable = draw(st.integers(0, 3)) == 0
    if untraceable:
        builder.branch(draw(st.integers(len(builder.inputs), len(builder.pool) - 1)))
    outputs = builder.outputs()
    if untraceable or any(op.kind == "region" for op in builder.ops):
        # BatchNorm's cumulative average (momentum=None) turns num_batches_tracked into a
        # Python float: data-dependent, which torch.export cannot capture (symbolic_trace
        # keeps BatchNorm a module call and can).
        builder.modules = {
            name: (kind, (a[0], 0.1 if a[1] is None else a[1], a[2])
                   if kind.startswith("batchnorm") else a)
            for name, (kind, a) in builder.modules.items()}
    return ModelSpec(
        inputs=tuple(builder.inputs),
        ops=tuple(builder.ops),
        outputs=outputs,
        seed=draw(st.integers(0, 2**16)),
        kwargs=draw(st.booleans()),
        untraceable=untraceable,
        modules=builder.modules,
        buffers=builder.buffers,
        params=builder.params,
        ids=builder.ids,
        frozen=tuple(sorted(builder.frozen)),
        shared=tuple(builder.shared),
        train=not builder.batchnorm_used or draw(st.integers(0, 3)) > 0,
        min_batch=builder.min_batch,
    )


class _Builder:
    """Draws ops one by one over the pool of live tensors (pool[i] is a shape)."""

    def __init__(self, draw: st.DrawFn, *, reuse: bool = True) -> None:
        self.draw = draw
        self.reuse = reuse
        self.inputs: list[Shape] = []
        self.pool: list[Shape] = []
        self.grad: list[bool] = []  # pool[i] depends on a parameter
        self.contiguous: list[bool] = []
        self.used: list[int] = []  # how many ops read pool[i]
        # storage[i]: the pool index whose tensor pool[i] is (a mutation's result is the
        # tensor it mutated); view[i]: pool[i] is a view of another entry's storage
        self.storage: list[int] = []
        self.view: list[bool] = []
        self.ops: list[Op] = []
        self.modules: dict[str, tuple[str, Any]] = {}
        self.buffers: dict[str, Shape] = {}
        self.params: dict[str, Shape] = {}
        self.ids: dict[int, int] = {}  # pool index of a token-id input -> vocabulary size
        self.frozen: set[str] = set()  # modules never tied: their gradient flags stay exact
        self.shared: list[tuple[Shape, int]] = []
        self.min_batch = 1
        # each table's shape, the x it counts, and the pool's size when it was made
        self.tables: list[tuple[Shape, int, int]] = []
        self.read: set[int] = set()  # the tables some op reads

    # -- bookkeeping

    def _add(self, op: Op, grad: bool, contiguous: bool = True, *, view: bool = False,
             same: int | None = None) -> None:
        """Append ``op`` and its results. ``view``: the results are views of ``srcs[0]``;
        ``same``: the one result is pool[same] itself (mutated in place)."""
        if op.module in self.frozen and op.kind != "region":
            grad = self._any_grad(op.srcs)  # a frozen module adds no gradient of its own
        for i in op.srcs:
            self.used[i] += 1
        self.ops.append(op)
        for shape in op.out:
            self.pool.append(shape)
            self.grad.append(grad)
            self.contiguous.append(contiguous)
            self.used.append(0)
            if same is not None:
                self.storage.append(self.storage[same])
                self.view.append(self.view[same])
            elif view:
                self.storage.append(self.storage[op.srcs[0]])
                self.view.append(True)
            else:
                self.storage.append(len(self.pool) - 1)
                self.view.append(False)
        if same is not None:  # every name of the mutated tensor now holds the new value
            for i, root in enumerate(self.storage):
                if root == self.storage[same]:
                    self.grad[i] = grad

    def _new_entry(self, shape: Shape) -> None:
        self.pool.append(shape)
        self.grad.append(False)
        self.contiguous.append(True)
        self.used.append(0)
        self.storage.append(len(self.pool) - 1)
        self.view.append(False)

    def _pick(self, ok: Any = None) -> int | None:
        """A pool index whose shape satisfies ``ok``, recent ones more likely."""
        choices = [i for i, s in self._floats() if ok is None or ok(s)]
        if not choices:
            return None
        if self.draw(st.booleans()):
            return choices[-1]
        return self.draw(st.sampled_from(choices))

    def _floats(self) -> list[tuple[int, Shape]]:
        """The pool's floating-point tensors (token ids only feed an Embedding)."""
        return [(i, s) for i, s in enumerate(self.pool) if i not in self.ids]

    def _any_grad(self, srcs: tuple[int, ...]) -> bool:
        return any(self.grad[i] for i in srcs)

    def _module(self, kind: str, arg: Any, *, trainable: bool = False) -> str:
        """A new submodule, or (sometimes) an existing one of the same kind and arg: shared.
        A new one with parameters is sometimes frozen (``requires_grad_(False)``)."""
        same = [n for n, (k, a) in self.modules.items()
                if k == kind and a == arg and not (trainable and n in self.frozen)]
        if same and (self.reuse or kind in ("relu", "gelu", "tanh")) and (
                self.draw(st.integers(0, 2)) == 0):
            return self.draw(st.sampled_from(same))
        name = f"{kind}{len(self.modules)}"
        self.modules[name] = (kind, arg)
        if not trainable and kind not in ("relu", "gelu", "tanh") and (
                self.draw(st.integers(0, 7)) == 0):
            self.frozen.add(name)
        return name

    def new_input(self, *, ids: bool = False) -> None:
        if ids or (self.inputs and self.draw(st.integers(0, 3)) == 0):
            # Token ids (int64, per sample (L,)) for an Embedding.
            length, vocab = self.draw(st.integers(2, 6)), self.draw(WIDTHS)
            self.ids[len(self.pool)] = vocab
            self.inputs.append((length,))
            self._new_entry((length,))
            return
        rank = self.draw(st.integers(1, 3))
        shape = tuple(self.draw(st.integers(2, 6) if rank > 1 else WIDTHS) for _ in range(rank))
        if rank > 1:
            shape = (self.draw(WIDTHS), *shape[1:])
        self.inputs.append(shape)
        self._new_entry(shape)

    # -- ops

    def random_op(self) -> None:
        kinds = ["linear", "conv", "norm", "act", "binary", "cat", "chunk", "reshape", "permute",
                 "matmul", "inplace", "reduce", "scalar", "where", "detach", "const",
                 "function"]
        if self.tables:
            kinds += ["rows", "rows"]
        if self.draw(st.integers(0, 3)) == 0:  # a third of the models have each of these
            kinds = ["region", "mutate", "shared_input", "batchnorm", "table"]
        getattr(self, self.draw(st.sampled_from(kinds)))(None)

    def linear(self, src: int | None, *, trainable: bool = False) -> None:
        src = self._pick() if src is None else src
        assert src is not None
        shape = self.pool[src]
        heads = [a[0] for k, a in self.modules.values() if k == "embedding" and a[1] == shape[-1]]
        width = self.draw(st.sampled_from(heads) if heads and self.draw(st.booleans()) else WIDTHS)
        bias = self.draw(st.booleans())
        name = self._module("linear", (shape[-1], width, bias), trainable=trainable)
        tie = ""
        if self.reuse and (self.draw(st.integers(0, 3)) == 0 or width in heads):
            # Tie to another Linear or an Embedding of the same weight shape (a GPT
            # embedding and its LM head).
            others = [n for n, (k, a) in self.modules.items()
                      if (k == "linear" and a[:2] == (shape[-1], width) and n != name)
                      or (k == "embedding" and a == (width, shape[-1]))]
            if others:
                tie = self.draw(st.sampled_from(others))
                self.frozen -= {name, tie}
        self._add(Op("linear", (src,), ((*shape[:-1], width),), module=name, tie=tie), True)

    def embed(self, src: int) -> None:
        width = self.draw(WIDTHS)
        name = self._module("embedding", (self.ids[src], width))
        self._add(Op("embed", (src,), ((*self.pool[src], width),), module=name), True)

    def conv(self, _: Any) -> None:
        src = self._pick(lambda s: len(s) in (2, 3))
        if src is None:
            return self.linear(None)
        shape = self.pool[src]
        out_c, k = self.draw(WIDTHS), self.draw(st.sampled_from([1, 3]))
        kind = "conv1d" if len(shape) == 2 else "conv2d"
        name = self._module(kind, (shape[0], out_c, k))
        self._add(Op(kind, (src,), ((out_c, *shape[1:]),), module=name), True)

    def norm(self, _: Any) -> None:
        src = self._pick()
        assert src is not None
        shape = self.pool[src]
        # GroupNorm needs more than one value per group in training.
        groups = [g for g in (1, 2, 4) if len(shape) >= 2 and shape[0] % g == 0
                  and math.prod(shape) > g]
        if groups and self.draw(st.booleans()):
            g = self.draw(st.sampled_from(groups))
            name = self._module("groupnorm", (g, shape[0]))
        else:
            name = self._module("layernorm", shape[-1])
        self._add(Op("norm", (src,), (shape,), module=name), True)

    def act(self, _: Any) -> None:
        src = self._pick()
        assert src is not None
        fn = self.draw(st.sampled_from(["relu", "gelu", "tanh"]))
        style = self.draw(st.sampled_from(["module", "function", "method"]))
        if style == "method" and fn == "gelu":
            style = "function"
        name = self._module(fn, None) if style == "module" else ""
        self._add(Op("act", (src,), (self.pool[src],), how=f"{fn}:{style}", module=name),
                  self.grad[src], self.contiguous[src])

    def binary(self, _: Any) -> None:
        a = self._pick()
        assert a is not None
        how = self.draw(st.sampled_from(["add", "mul"]))
        shape = self.pool[a]
        partners = [i for i, s in self._floats() if s == shape]
        if self.draw(st.integers(0, 2)) == 0:
            # A registered buffer: the whole per-sample shape or the last dim (broadcast).
            bshape = shape if self.draw(st.booleans()) else shape[-1:]
            same = [n for n, b in self.buffers.items() if b == bshape]
            if same and self.draw(st.booleans()):
                name = self.draw(st.sampled_from(same))  # one buffer read by several ops
            else:
                name = f"buf{len(self.buffers)}"
                self.buffers[name] = bshape
            self._add(Op("binary", (a,), (shape,), how=how, arg=name), self.grad[a])
            return
        b = self.draw(st.sampled_from(partners))
        self._add(Op("binary", (a, b), (shape,), how=how), self._any_grad((a, b)))

    def cat(self, _: Any) -> None:
        a = self._pick()
        assert a is not None
        shape = self.pool[a]
        dims = list(range(len(shape)))
        dim = self.draw(st.sampled_from(dims))
        partners = [i for i, s in self._floats()
                    if len(s) == len(shape) and all(s[d] == shape[d] for d in dims if d != dim)]
        b = self.draw(st.sampled_from(partners))
        joined = list(shape)
        joined[dim] += self.pool[b][dim]
        out = tuple(joined)
        name = ""
        if dim == len(shape) - 1 and self.draw(st.booleans()):
            name = self._module("linear", (out[-1], shape[-1], True))
            out = shape
        self._add(Op("cat", (a, b), (out,), arg=dim, module=name), self._any_grad((a, b)) or
                  bool(name))

    def chunk(self, _: Any) -> None:
        src = self._pick(lambda s: any(n >= 2 for n in s))
        if src is None:
            return self.act(None)
        shape = self.pool[src]
        dim = self.draw(st.sampled_from([d for d, n in enumerate(shape) if n >= 2]))
        n = shape[dim]
        if self.draw(st.booleans()):
            pieces = self.draw(st.integers(2, min(n, 3)))
            sizes = [len(r) for r in torch.arange(n).chunk(pieces)]
            how = "chunk"
            arg: Any = (dim, pieces)
        else:
            first = self.draw(st.integers(1, n - 1))
            sizes = [first, n - first]
            how = "split"
            arg = (dim, tuple(sizes))
        outs = tuple(tuple(s if d == dim else m for d, m in enumerate(shape)) for s in sizes)
        self._add(Op("chunk", (src,), outs, how=how, arg=arg), self.grad[src], False, view=True)

    def reshape(self, _: Any) -> None:
        src = self._pick()
        assert src is not None
        shape = self.pool[src]
        style = self.draw(st.sampled_from(["reshape", "view", "flatten"]))
        if style == "view" and not self.contiguous[src]:
            style = "reshape"
        if len(shape) == 1:
            divisors = [d for d in range(2, shape[0]) if shape[0] % d == 0]
            if not divisors:
                return self.act(None)
            a = self.draw(st.sampled_from(divisors))
            out: Shape = (a, shape[0] // a)
            if style == "flatten":
                style = "unflatten"
        elif len(shape) == 2:
            out = (math.prod(shape),)
        else:
            out = (shape[0], math.prod(shape[1:]))
        self._add(Op("reshape", (src,), (out,), how=style), self.grad[src],
                  self.contiguous[src], view=True)

    def permute(self, _: Any) -> None:
        src = self._pick(lambda s: len(s) >= 2)
        if src is None:
            return self.reshape(None)
        shape = self.pool[src]
        perm = tuple(self.draw(st.permutations(range(len(shape)))))
        back = self.draw(st.booleans())
        out = shape if back else tuple(shape[p] for p in perm)
        self._add(Op("permute", (src,), (out,), arg=(perm, back)), self.grad[src], back,
                  view=not back)

    def matmul(self, _: Any) -> None:
        a = self._pick(lambda s: len(s) >= 2)
        if a is None:
            return self.linear(None)
        shape = self.pool[a]
        partners = [i for i, s in self._floats()
                    if len(s) == len(shape) and s[:-2] == shape[:-2] and s[-2] == shape[-1]]
        how = self.draw(st.sampled_from(["other", "self", "param"]))
        if how == "other" and partners:
            b = self.draw(st.sampled_from(partners))
            out = (*shape[:-1], self.pool[b][-1])
            self._add(Op("matmul", (a, b), (out,), how=how), self._any_grad((a, b)))
        elif how == "self":
            self._add(Op("matmul", (a,), ((*shape[:-1], shape[-2]),), how=how), self.grad[a])
        else:
            # a (in, out) matrix of the right width; a table's (width,) row is no matmul's
            same = [n for n, p in self.params.items() if len(p) == 2 and p[0] == shape[-1]]
            if same and self.reuse and self.draw(st.booleans()):
                name = self.draw(st.sampled_from(same))  # one Parameter read by several ops
                width = self.params[name][1]
            else:
                width = self.draw(WIDTHS)
                name = f"w{len(self.params)}"
                self.params[name] = (shape[-1], width)
            self._add(Op("matmul", (a,), ((*shape[:-1], width),), how="param", arg=name), True)

    def inplace(self, _: Any) -> None:
        a = self._pick()
        assert a is not None
        shape = self.pool[a]
        how = self.draw(st.sampled_from(["relu_", "add_", "mul_", "iadd", "view_relu_"]))
        partners = [i for i, s in self._floats() if s == shape]
        srcs = (a, self.draw(st.sampled_from(partners))) if how in ("add_", "iadd") else (a,)
        # ``arg``: whether the fresh intermediate is a Linear's output (else x * 0.5).
        name = ""
        if self.draw(st.booleans()):
            name = self._module("linear", (shape[-1], shape[-1], True))
        self._add(Op("inplace", srcs, (shape,), how=how, module=name),
                  self._any_grad(srcs) or bool(name), self.contiguous[a] or bool(name))

    def where(self, _: Any) -> None:
        a = self._pick()
        assert a is not None
        b = self.draw(st.sampled_from([i for i, s in self._floats() if s == self.pool[a]]))
        self._add(Op("where", (a, b), (self.pool[a],)), self._any_grad((a, b)))

    def detach(self, _: Any) -> None:
        src = self._pick()
        assert src is not None
        self._add(Op("detach", (src,), (self.pool[src],)), False, self.contiguous[src])

    def function(self, _: Any) -> None:
        src = self._pick()
        assert src is not None
        scale = self.draw(st.sampled_from([-1.0, 0.5]))
        self._add(Op("function", (src,), (self.pool[src],), arg=scale), self.grad[src])

    def const(self, _: Any) -> None:
        src = self._pick()
        assert src is not None
        how = self.draw(st.sampled_from(["arange", "ones_like", "new_full"]))
        self._add(Op("const", (src,), (self.pool[src],), how=how), self.grad[src])

    def reduce(self, _: Any) -> None:
        src = self._pick(lambda s: len(s) >= 1)
        assert src is not None
        shape = self.pool[src]
        dim = self.draw(st.sampled_from(range(len(shape))))
        keep = len(shape) == 1 or self.draw(st.booleans())
        how = self.draw(st.sampled_from(["mean", "sum", "amax"]))
        out = tuple(1 if d == dim else n for d, n in enumerate(shape)) if keep else tuple(
            n for d, n in enumerate(shape) if d != dim)
        self._add(Op("reduce", (src,), (out,), how=how, arg=(dim, keep)), self.grad[src])

    def scalar(self, _: Any) -> None:
        src = self._pick()
        assert src is not None
        how = self.draw(st.sampled_from(["mul", "add", "softmax", "neg"]))
        self._add(Op("scalar", (src,), (self.pool[src],), how=how), self.grad[src],
                  self.contiguous[src])

    def region(self, _: Any) -> None:
        src = self._pick()
        assert src is not None
        shape = self.pool[src]
        how = self.draw(st.sampled_from(["no_grad", "set_grad", "enable_grad", "autocast",
                                         "autocast_off", "autocast_f64"]))
        out, name, arg = shape, "", None
        if how in ("no_grad", "enable_grad", "autocast_f64"):  # a Linear inside
            width = self.draw(WIDTHS)
            name = self._module("linear", (shape[-1], width, self.draw(st.booleans())))
            out = (*shape[:-1], width)
        elif how in ("autocast", "autocast_off"):  # x.float() @ a float64 Parameter .float()
            width = self.draw(WIDTHS)
            arg = f"w{len(self.params)}"
            self.params[arg] = (shape[-1], width)
            out = (*shape[:-1], width)
        # no_grad and set_grad(False) stop every gradient; enable_grad inside no_grad lets
        # the Linear's own through but none back into x
        grad = {"no_grad": False, "set_grad": False, "enable_grad": name not in self.frozen,
                "autocast": True, "autocast_off": True,
                "autocast_f64": self.grad[src] or name not in self.frozen}[how]
        self._add(Op("region", (src,), (out,), how=how, arg=arg, module=name), grad)

    def mutate(self, _: Any) -> None:
        # A model input, or a value some op already read; a tensor of its own (no view of
        # it or by it in the pool: aliasing through views is not what this op fuzzes).
        first = len(self.inputs)
        targets = [i for i, _s in self._floats()
                   if (i < first or self.used[i] > 0) and not self.view[i]
                   and not any(self.view[j] and self.storage[j] == self.storage[i]
                               for j in range(len(self.pool)))]
        if not targets:
            return self.inplace(None)
        a = self.draw(st.sampled_from(targets))
        shape = self.pool[a]
        op = self.draw(st.sampled_from(["mul_", "add_", "relu_", "add_y"]))
        srcs: tuple[int, ...] = (a,)
        if op == "add_y":
            partners = [i for i, s in self._floats() if s == shape and i != a
                        and self.storage[i] != self.storage[a]]
            if not partners:
                op = "add_"
            else:
                srcs = (a, self.draw(st.sampled_from(partners)))
        style = self.draw(st.sampled_from(["result", "statement"]))
        self._add(Op("mutate", srcs, (shape,), how=f"{op}:{style}"), self._any_grad(srcs),
                  self.contiguous[a], same=a)

    def shared_input(self, _: Any) -> None:
        src = self._pick()
        assert src is not None
        shape = self.pool[src]
        if len(shape) == 2 and self.draw(st.integers(0, 2)) == 0:
            # HF-style position ids (1, L) into an Embedding, added to x of shape (L, D)
            length = shape[0]
            index = self._shared_input((1, length), length + self.draw(st.integers(0, 2)))
            if index is not None:
                name = self._module("embedding", (self.shared[index][1], shape[1]))
                self._add(Op("shared", (src,), (shape,), how="positions", arg=index,
                             module=name), True)
                return
        dims = self.draw(st.integers(1, len(shape)))
        mask = shape[len(shape) - dims:]
        if self.draw(st.booleans()):
            mask = (1, *mask[1:])  # broadcast along its first dim
        index = self._shared_input(mask, 0)
        if index is None:
            return self.scalar(None)
        how = self.draw(st.sampled_from(["add", "mul", "fill"]))
        self._add(Op("shared", (src,), (shape,), how=how, arg=index), self.grad[src])

    def _shared_input(self, shape: Shape, vocab: int) -> int | None:
        """The index of a shared input of this shape and kind: an existing one (read by
        several ops) or a new one; None when there are MAX_SHARED of other shapes."""
        same = [i for i, (s, v) in enumerate(self.shared) if s == shape and bool(v) == bool(vocab)]
        if same and (len(self.shared) == MAX_SHARED or self.draw(st.booleans())):
            return self.draw(st.sampled_from(same))
        if len(self.shared) == MAX_SHARED:
            return None
        self.shared.append((shape, vocab))
        return len(self.shared) - 1

    def table(self, src: int | None) -> None:
        """A table of x = pool[src] (default: any of rank 2; none fits: a scalar op), or
        of token ids of shape (L,)."""
        src = self._pick(lambda s: len(s) == 2) if src is None else src
        if src is None or not (len(self.pool[src]) == 2 or src in self.ids):
            return None if src is not None else self.scalar(None)
        length, width = self.pool[src][0], self.pool[src][-1]
        # (1, L, 1) broadcasts over any width (and ids have none to match)
        width = 1 if src in self.ids else self.draw(st.sampled_from([1, width]))
        arg = f"w{len(self.params)}"
        self.params[arg] = (width,)
        self.tables.append(((length, width), src, len(self.pool)))
        self._add(Op("table", (src,), (), arg=arg), False)

    def _fits(self, t: int) -> list[int]:
        """The pool entries table t broadcasts against: (L, F), or (L, any) for F = 1."""
        (length, width), _x, _made = self.tables[t]
        return [i for i, s in self._floats()
                if len(s) == 2 and s[0] == length and width in (1, s[1])]

    def rows(self, _: Any, index: int | None = None) -> None:
        """A read of table ``index`` (default: any table some pool entry fits), by a
        value made after the table where there is one (as a late layer's activations
        read a rotary table made first: a stage that receives the table and the count
        may then receive no batched value made before them)."""
        fits = [t for t in range(len(self.tables)) if self._fits(t)]
        if index is None and not fits:
            return self.scalar(None)
        t = self.draw(st.sampled_from(fits)) if index is None else index
        _shape, counted, made = self.tables[t]
        entries = self._fits(t)  # the table's own x, unless token ids
        if not entries:
            return None
        later = [i for i in entries if i >= made]
        src = self.draw(st.sampled_from(later or entries))
        how = self.draw(st.sampled_from(["expand", "reshape"]))
        self.read.add(t)
        self._add(Op("rows", (src, counted), (self.pool[src],), how=how, arg=t), True)

    def batchnorm(self, _: Any) -> None:
        src = self._pick(lambda s: 1 <= len(s) <= 3)
        if src is None:
            return self.norm(None)
        shape = self.pool[src]
        kind = "batchnorm2d" if len(shape) == 3 else "batchnorm1d"
        momentum = self.draw(st.sampled_from([0.1, 0.3, None]))
        affine = self.draw(st.booleans())
        name = self._module(kind, (shape[0], momentum, affine))
        if math.prod(shape[1:]) == 1:  # one value per channel and sample
            self.min_batch = 2
        self._add(Op("batchnorm", (src,), (shape,), module=name), affine or self.grad[src])

    @property
    def batchnorm_used(self) -> bool:
        return any(op.kind == "batchnorm" for op in self.ops)

    def branch(self, src: int) -> None:
        self._add(Op("branch", (src,), (self.pool[src],)), self.grad[src], self.contiguous[src])

    # -- outputs

    def outputs(self) -> Any:
        """A tree of pool indices: every unread op result, plus maybe an extra leaf,
        at most 4 leaves, at least one that needs a gradient."""
        first = len(self.inputs)
        sinks = [i for i in range(first, len(self.pool)) if self.used[i] == 0][-4:]
        grads = [i for i in sinks if self.grad[i]]
        if not grads:
            grads = [i for i in range(first, len(self.pool)) if self.grad[i]][-1:]
            sinks = [*sinks[-3:], *grads]
        leaves = list(sinks)
        if len(leaves) < 4 and self.draw(st.integers(0, 3)) == 0:
            leaves.append(self.draw(st.sampled_from([i for i, _ in self._floats()])))  # or an input
        structure = self.draw(st.sampled_from(["tuple", "dict", "nested", "single"]))
        if structure == "single" and len(leaves) == 1:
            return leaves[0]
        if structure == "dict":
            return {f"out{n}": i for n, i in enumerate(leaves)}
        if structure == "nested" and len(leaves) >= 2:
            return (leaves[0], {"rest": tuple(leaves[1:])})
        return tuple(leaves)


# ---------------------------------------------------------------------------- the module


class ScaledGradient(torch.autograd.Function):
    """The identity, whose backward scales the gradient (the ``function`` op)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _make_module(kind: str, arg: Any) -> nn.Module:
    if kind == "linear":
        return nn.Linear(arg[0], arg[1], bias=arg[2])
    if kind == "conv1d":
        return nn.Conv1d(arg[0], arg[1], arg[2], padding=arg[2] // 2)
    if kind == "conv2d":
        return nn.Conv2d(arg[0], arg[1], arg[2], padding=arg[2] // 2)
    if kind == "embedding":
        return nn.Embedding(arg[0], arg[1])
    if kind == "groupnorm":
        return nn.GroupNorm(arg[0], arg[1])
    if kind == "layernorm":
        return nn.LayerNorm(arg)
    if kind in ("batchnorm1d", "batchnorm2d"):
        cls = nn.BatchNorm1d if kind == "batchnorm1d" else nn.BatchNorm2d
        return cls(arg[0], momentum=arg[1], affine=arg[2])
    return {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}[kind]()


class FuzzModel(nn.Module):
    """Interprets ``spec.ops`` over a pool of tensors (the inputs first)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        gen = torch.Generator().manual_seed(spec.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            self.layers = nn.ModuleDict(
                {name: _make_module(kind, arg) for name, (kind, arg) in spec.modules.items()}
            )
        for name in spec.frozen:
            self.layers[name].requires_grad_(False)
        for op in spec.ops:
            if op.tie:
                self.layers[op.module].weight = self.layers[op.tie].weight
        for name, shape in spec.buffers.items():
            self.register_buffer(name, torch.randn(shape, generator=gen) * 0.5 + 1.0)
        self.weights = nn.ParameterDict(
            {name: nn.Parameter(torch.randn(shape, generator=gen) / math.sqrt(shape[0]))
             for name, shape in spec.params.items()}
        )
        self.double()
        self.train(spec.train)

    def run(self, xs: tuple[torch.Tensor, ...]) -> Any:
        first = len(self.spec.inputs)
        pool: list[torch.Tensor] = list(xs[:first])
        shared = xs[first:]
        tables: list[tuple[Any, torch.Tensor]] = []  # (batch count, table) per table op
        for op in self.spec.ops:
            if op.kind == "table":  # made now, read by later ops
                x = pool[op.srcs[0]]
                w = self.weights[op.arg]
                positions = torch.arange(x.shape[1], dtype=w.dtype).unsqueeze(0)
                tables.append((x.size(0), torch.cos(positions.unsqueeze(-1) * w)))
            elif op.kind == "rows":
                count, table = tables[op.arg]
                y = pool[op.srcs[0]]
                if op.how == "expand":  # each sample twice, as a KV head repeated
                    pool.append(y.unsqueeze(1).expand(count, 2, -1, -1).sum(1) * table)
                else:
                    pool.append((y + table).reshape(count, -1, y.shape[-1]))
            else:
                pool.extend(self._op(op, [pool[i] for i in op.srcs], shared))
        return _tree_map(self.spec.outputs, lambda i: pool[i])

    def _op(self, op: Op, xs: list[torch.Tensor], shared: tuple[torch.Tensor, ...]
            ) -> list[torch.Tensor]:
        kind, how, x = op.kind, op.how, xs[0]
        layer = self.layers[op.module] if op.module else None
        if kind in ("region", "mutate", "shared"):
            return [self._new_op(op, xs, layer, shared)]
        if kind in ("linear", "conv1d", "conv2d", "norm", "embed", "batchnorm"):
            assert layer is not None
            return [layer(x)]
        if kind == "act":
            fn, style = how.split(":")
            if style == "module":
                assert layer is not None
                return [layer(x)]
            if style == "function":
                return [{"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}[fn](x)]
            return [x.relu() if fn == "relu" else x.tanh()]
        if kind == "binary":
            other = getattr(self, op.arg) if op.arg else xs[1]
            return [x + other if how == "add" else x * other]
        if kind == "cat":
            y = torch.cat([x, xs[1]], dim=op.arg + 1)
            return [layer(y) if layer is not None else y]
        if kind == "chunk":
            dim, parts = op.arg
            # Indexed, not iterated: symbolic_trace cannot iterate a Proxy.
            if how == "chunk":
                pieces = x.chunk(parts, dim=dim + 1)
            else:
                pieces = torch.split(x, list(parts), dim=dim + 1)
            return [pieces[i] for i in range(len(op.out))]
        if kind == "reshape":
            shape = op.out[0]
            if how == "view":
                return [x.view(x.size(0), *shape)]
            if how == "unflatten":
                return [x.unflatten(1, shape)]
            if how == "flatten":
                return [x.flatten(1) if len(shape) == 1 else x.flatten(2)]
            return [x.reshape(x.shape[0], *shape)]
        if kind == "permute":
            perm, back = op.arg
            y = x.permute(0, *(p + 1 for p in perm))
            if back:
                inverse = sorted(range(len(perm)), key=lambda d: perm[d])
                y = (y * 2.0).permute(0, *(p + 1 for p in inverse))
            return [y]
        if kind == "matmul":
            if how == "other":
                return [x @ xs[1]]
            if how == "self":
                return [torch.matmul(x, x.transpose(-1, -2))]
            return [x @ self.weights[op.arg]]
        if kind == "inplace":
            fresh = layer(x) if layer is not None else x * 0.5
            if how == "relu_":
                return [fresh.relu_()]
            if how == "add_":
                fresh.add_(xs[1])
                return [fresh]
            if how == "mul_":
                return [fresh.mul_(1.5)]
            if how == "view_relu_":
                # In place through a view: mutates ``fresh``, the view's base.
                fresh.unsqueeze(1).relu_()
                return [fresh]
            fresh += xs[1]
            return [fresh]
        if kind == "where":
            mask = x > 0  # a bool tensor, maybe sent to the next stage
            return [torch.where(mask, x, xs[1])]
        if kind == "detach":
            return [x.detach() * 2.0]
        if kind == "function":
            return [ScaledGradient.apply(x, op.arg)]
        if kind == "const":
            # Tensors made inside forward, from a size or like an activation.
            if how == "arange":
                return [x + torch.arange(x.shape[-1], dtype=x.dtype) / 8.0]
            if how == "ones_like":
                return [x * torch.ones_like(x).cumsum(-1)]
            return [x - x.new_full((x.shape[-1],), 0.25)]
        if kind == "reduce":
            dim, keep = op.arg
            if how == "amax":
                return [x.amax(dim=dim + 1, keepdim=keep)]
            reduce = torch.mean if how == "mean" else torch.sum
            return [reduce(x, dim=dim + 1, keepdim=keep)]
        if kind == "scalar":
            if how == "mul":
                return [x * 0.75]
            if how == "add":
                return [x + 1.0]
            if how == "neg":
                return [-x]
            return [F.softmax(x, dim=-1)]
        if kind == "branch":
            # Python control flow on a size: symbolic_trace fails, export specialises.
            if x.shape[-1] > 8:
                return [torch.tanh(x)]
            return [x * 2.0]
        raise AssertionError(kind)

    def _new_op(self, op: Op, xs: list[torch.Tensor], layer: nn.Module | None,
                shared: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The ops of regions, in-place mutations and shared inputs."""
        how, x = op.how, xs[0]
        if op.kind == "region":
            if how == "no_grad":
                assert layer is not None
                with torch.no_grad():
                    return layer(x)
            if how == "set_grad":
                with torch.set_grad_enabled(False):
                    return torch.tanh(x) * 2.0
            if how == "enable_grad":
                assert layer is not None
                with torch.no_grad():
                    h = x * 0.5
                    with torch.enable_grad():
                        return layer(h)
            if how == "autocast_f64":  # float64: autocast casts only float32
                assert layer is not None
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return layer(x)
            w = self.weights[op.arg]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if how == "autocast":  # the matmul runs in bfloat16
                    return (x.float() @ w.float()).double()
                with torch.autocast("cpu", enabled=False):  # float32, not bfloat16
                    return (x.float() @ w.float()).double()
        if op.kind == "mutate":
            name, style = how.split(":")
            if name == "mul_":
                y = x.mul_(1.5)
            elif name == "add_":
                y = x.add_(0.25)
            elif name == "relu_":
                y = x.relu_()
            else:
                y = x.add_(xs[1])
            return y if style == "result" else x  # later readers: the op's result or x
        s = shared[op.arg]
        if how == "positions":
            assert layer is not None
            return x + layer(s)
        if how == "add":
            return x + s
        if how == "mul":
            return x * s
        return x.masked_fill(s > 0, 0.0)


class FuzzModel1(FuzzModel):
    def forward(self, x0: torch.Tensor) -> Any:
        return self.run((x0,))


class FuzzModel2(FuzzModel):
    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> Any:
        return self.run((x0, x1))


class FuzzModel3(FuzzModel):
    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> Any:
        return self.run((x0, x1, x2))


class FuzzModel4(FuzzModel):
    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, x3: torch.Tensor
                ) -> Any:
        return self.run((x0, x1, x2, x3))


class FuzzModel5(FuzzModel):
    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, x3: torch.Tensor,
                x4: torch.Tensor) -> Any:
        return self.run((x0, x1, x2, x3, x4))


def build_model(spec: ModelSpec) -> FuzzModel:
    classes = (FuzzModel1, FuzzModel2, FuzzModel3, FuzzModel4, FuzzModel5)
    return classes[len(spec.inputs) + len(spec.shared) - 1](spec)


def example_inputs(spec: ModelSpec, *, batch: int, seed: int
                   ) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """``(args, kwargs)`` of ``batch`` samples: positional or by keyword per the spec. The
    shared inputs are the same whatever ``batch`` and ``seed``: a mask, position ids."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randint(spec.ids[i], (batch, *shape), generator=gen) if i in spec.ids
          else torch.randn((batch, *shape), generator=gen, dtype=torch.float64)
          for i, shape in enumerate(spec.inputs)]
    fixed = torch.Generator().manual_seed(spec.seed)
    xs += [torch.arange(shape[1]).unsqueeze(0) if vocab
           else torch.randn(shape, generator=fixed, dtype=torch.float64)
           for shape, vocab in spec.shared]
    if spec.kwargs:
        return (), {f"x{i}": x for i, x in enumerate(xs)}
    return tuple(xs), {}


def output_leaves(output: Any) -> list[torch.Tensor]:
    if isinstance(output, dict):
        return [t for v in output.values() for t in output_leaves(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in output_leaves(v)]
    return [output]


def _tree_map(tree: Any, fn: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _tree_map(v, fn) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_tree_map(v, fn) for v in tree)
    return fn(tree)
