"""Bytes per node: parameters and buffers it owns, what it outputs, what backward keeps.

Saved-for-backward bytes come from autograd itself: each op node runs alone under
``torch.autograd.graph.saved_tensors_hooks`` and every tensor its backward keeps is
classified by its storage, since a view keeps all of its storage alive and two views
of one storage take its bytes once. Parameters and buffers are not activations and are
skipped. A saved tensor that shares storage with one of the node's inputs is charged
once to the node that made that storage (its output stays alive for backward), however
many consumers save it and through however many views and aliases (``reshape``, a
``dropout`` of p = 0 that returns its input); every other saved storage is an
intermediate of the node and charged to the node.

What a stage recomputed selectively (torch's SAC) may keep of a node comes from the same
run: the outputs of the aten ops the runtime's policy keeps (``SELECTIVE_KEEPS``: the
matmuls and the fused attention kernels), each with the work per element and width its
keep rule reads, as a dispatch mode sees them run (``KeptWrites``), which also sees a node
write in place into such an output (``writes_kept``: SAC would hand the backward the
written value, so every keep level of the model skips such outputs,
fxpipe.lower.keep_levels).

A node of a layer tracing copied from another (``meta.COPY_OF``) is not run: it keeps
what the node it copies keeps, of its own inputs in the same places, and costs the
same FLOPs. Its value is that node's result, which the next copies only compare with
their own node's inputs; a node that runs gets new tensors of its shapes instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from fxpipe import meta
from fxpipe.kernels import Execution
from fxpipe.metadevice import named_state
from fxpipe.passes.base import OP_NODES, MetaInterpreter, copied_from, fresh_like, tensor_leaves
from fxpipe.passes.flops import FlopCounter
from fxpipe.passes.shapes import value_info
from fxpipe.runtime.recompute import Kept, KeptWrites

__all__ = ["annotate_memory"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> StorageWeakRef:
    """What identifies ``t``'s storage while it lives (equal for its views and aliases)."""
    return StorageWeakRef(t.untyped_storage())


@dataclass(frozen=True)
class _Ran:
    """What running a node that others copy showed: what its inputs were before it ran
    (``_specs``), the bytes backward keeps of its own, the places (in
    ``all_input_nodes``) of the inputs it keeps, whether it keeps its output, the place
    of the input whose storage its result is a view of (None: storage of its own), and
    its result with what it was (an in-place op later may change it), and what selective
    recompute keeps of it."""

    inputs: list[Any]
    own: int
    kept_inputs: tuple[int, ...]
    keeps_output: bool
    view_of: int | None
    result: Any
    result_was: Any
    selective: tuple[Kept, ...]
    writes_kept: frozenset[tuple[int, int]]


class _MemoryCount(MetaInterpreter):
    pass_name = "memory accounting"

    def __init__(self, gm: torch.fx.GraphModule, execution: Execution | None,
                 shapes: bool, flops: bool) -> None:
        super().__init__(gm, execution)
        self.shapes = shapes
        self.flops = FlopCounter() if flops else None
        if flops:
            self.pass_name = "memory and FLOP accounting"
        self.parameter_names = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        # Every name of a tensor -> the first name it has (tied parameters share one).
        first: dict[int, str] = {}
        self.canonical = {name: first.setdefault(id(t), name) for name, t in named_state(gm)}
        self.intermediate: dict[torch.fx.Node, int] = {}
        self.selective: dict[torch.fx.Node, tuple[Kept, ...]] = {}  # what SAC may keep
        # per node, the (work, width) of the kept outputs it writes into in place
        self.writes_kept: dict[torch.fx.Node, set[tuple[int, int]]] = {}
        self.kept_writes = KeptWrites(lambda _op, _made: None)  # the run's kept storages
        self.output_saved: set[torch.fx.Node] = set()  # nodes whose storage backward keeps
        # A node whose result is a view or alias of an input -> the node that made that
        # storage (its bytes are charged there once, whoever keeps which view of it).
        self.made_by: dict[torch.fx.Node, torch.fx.Node] = {}
        self.state_storages: set[StorageWeakRef] | None = None  # parameters' and buffers'
        self.owned: dict[torch.fx.Node, meta.MemoryInfo] = {}  # saved_bytes filled at the end
        self.copy_of = copied_from(gm)
        self.copied = frozenset(self.copy_of.values())
        self.ran: dict[torch.fx.Node, _Ran] = {}  # the nodes in ``copied``, once run
        # Copies whose value is the copied node's own result: what other copies compare
        # (``_inputs``) is the same, and a node that runs is first given a new one.
        self.aliased: set[torch.fx.Node] = set()

    def execute(self, n: torch.fx.Node) -> Any:
        template = self.copy_of.get(n)
        given = self._inputs(n) if template is not None or n in self.copied else None
        ran = self.ran.get(template) if template is not None else None
        if (ran is not None and given == ran.inputs
                and self._specs(ran.result) == ran.result_was):
            return self._as_copy(n, ran)
        for node in self.aliased.intersection(n.all_input_nodes):  # run on values of its own
            self.env[node] = fresh_like(self.env[node])
            self.aliased.discard(node)
        if self.flops is not None:  # outside the hooks below: its own runs keep tensors
            self.flops.count(self, n)
        if n.op not in OP_NODES:
            return super().execute(n)
        if self.state_storages is None:
            self.state_storages = {_storage(t) for t in self.meta_state.values()}
        # the storage of each input -> the node that made it
        inputs = {
            _storage(t): self._maker(producer)
            for producer in n.all_input_nodes
            for t in tensor_leaves(self.env.get(producer))
        }
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        self.kept_writes.added = []
        written = self.writes_kept.setdefault(n, set())
        self.kept_writes.on_write = lambda _op, made: written.add(made)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), self.kept_writes:
            result = super().execute(n)
        self.selective[n] = tuple(self.kept_writes.added)
        outputs = {_storage(t) for t in tensor_leaves(result)}
        view_of = self._view_of(n, outputs, inputs)
        own: dict[StorageWeakRef, int] = {}
        kept, keeps_output = set(), False
        for t in saved:
            storage = _storage(t)
            if storage in self.state_storages:
                continue
            maker = inputs.get(storage)
            if maker is not None:
                kept.add(maker)
            elif storage in outputs:
                keeps_output = True
            else:
                own[storage] = t.untyped_storage().nbytes()
        self.output_saved |= kept
        if keeps_output:
            self.output_saved.add(n)
        self.intermediate[n] = sum(own.values())
        # A node that changed its inputs in place (grad, shape) is no node to copy: its
        # copies must change theirs.
        if n in self.copied and given == self._inputs(n):
            places = tuple(i for i, node in enumerate(n.all_input_nodes)
                           if self._maker(node) in kept)
            assert given is not None
            self.ran[n] = _Ran(given, self.intermediate[n], places, keeps_output, view_of,
                               result, self._specs(result), self.selective[n],
                               frozenset(self.writes_kept.get(n, ())))
        return result

    def _maker(self, node: torch.fx.Node) -> torch.fx.Node:
        """The node that made ``node``'s storage: itself, unless its result is a view or
        alias of an input's."""
        return self.made_by.get(node, node)

    def _view_of(self, n: torch.fx.Node, outputs: set[StorageWeakRef],
                 inputs: dict[StorageWeakRef, torch.fx.Node]) -> int | None:
        """Where ``n``'s result shares every storage with one input (a view, an alias, a
        tuple of views of it): record that input's maker as the maker of ``n``'s and return
        the input's place in ``all_input_nodes``."""
        makers = {inputs.get(storage) for storage in outputs}
        if len(makers) != 1 or None in makers:
            return None
        (maker,) = makers
        assert maker is not None
        self.made_by[n] = maker
        return next(i for i, node in enumerate(n.all_input_nodes) if self._maker(node) is maker)

    def _inputs(self, n: torch.fx.Node) -> list[Any]:
        """What ``n``'s input values are (``_specs``), in ``all_input_nodes`` order."""
        return [self._specs(self.env[node]) for node in n.all_input_nodes]

    def _specs(self, value: Any) -> Any:
        """``value`` with each tensor as its shape, strides, dtype, whether it requires
        grad and whether it is a parameter or buffer."""

        def spec(t: torch.Tensor) -> tuple[Any, ...]:
            return (t.shape, t.stride(), t.dtype, t.requires_grad, id(t) in self.state_ids)

        if isinstance(value, torch.Tensor):  # the common case, without pytree's walk
            return spec(value)
        return pytree.tree_map_only(torch.Tensor, spec, value)

    def _as_copy(self, n: torch.fx.Node, ran: _Ran) -> Any:
        """``n`` as running it would record it: as the node it copies ran (``ran``)."""
        if self.flops is not None:
            meta.FLOPS.set(n, meta.FLOPS.get(self.copy_of[n]))
        inputs = n.all_input_nodes
        self.output_saved.update(self._maker(inputs[i]) for i in ran.kept_inputs)
        if ran.view_of is not None:
            self.made_by[n] = self._maker(inputs[ran.view_of])
        if ran.keeps_output:
            self.output_saved.add(self._maker(n))
        self.intermediate[n] = ran.own
        self.selective[n] = ran.selective
        if ran.writes_kept:
            self.writes_kept[n] = set(ran.writes_kept)
        self.aliased.add(n)
        return ran.result

    def visit(self, node: torch.fx.Node, result: Any) -> None:
        if self.shapes:
            meta.SHAPE.set(node, value_info(result))
        names: list[str] = []
        if node.op == "get_attr" and isinstance(result, torch.Tensor):
            names.append(str(node.target))
        elif node.op == "call_module":
            submodule = self.module.get_submodule(str(node.target))
            names += [f"{node.target}.{k}" for k, _ in named_state(submodule)]
        owned = {self.canonical[name]: _nbytes(self.meta_state[name]) for name in names}
        params = tuple(sorted((k, v) for k, v in owned.items() if k in self.parameter_names))
        buffers = tuple(sorted((k, v) for k, v in owned.items() if k not in self.parameter_names))
        self.owned[node] = meta.MemoryInfo(
            param_bytes=sum(size for _, size in params),
            buffer_bytes=sum(size for _, size in buffers),
            output_bytes=sum(_nbytes(t) for t in tensor_leaves(result)),
            saved_bytes=0,
            params=params,
            buffers=buffers,
        )


def annotate_memory(
    gm: torch.fx.GraphModule, *flat_inputs: Any, execution: Execution | None = None,
    shapes: bool = False, flops: bool = False,
) -> torch.fx.GraphModule:
    """Fill ``meta.BYTES`` on every node; with ``shapes``, ``meta.SHAPE`` too, as
    ``annotate_shapes`` would, and with ``flops``, ``meta.FLOPS``, as ``annotate_flops``
    would, from the same run of the graph (each run is seconds on a model of thousands of
    ops)."""
    counter = _MemoryCount(gm, execution, shapes, flops)
    counter.analyze(*flat_inputs)
    for node, owned in counter.owned.items():
        saved = counter.intermediate.get(node, 0)
        if node in counter.output_saved and node.op in OP_NODES:
            saved += owned.output_bytes
        meta.BYTES.set(node, replace(owned, saved_bytes=saved,
                                     selective=counter.selective.get(node, ()),
                                     writes_kept=tuple(sorted(counter.writes_kept.get(node, ())))))
    return gm
