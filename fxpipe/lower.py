"""Lower an annotated FX graph to the partitioner's plain-data ``Problem``.

Problem nodes are the graph's op nodes. Placeholders are free (the runner hands
each stage the mini-batch inputs it reads) and ``get_attr`` nodes are not
nodes at all: a parameter read by one op is that op's, a parameter read by
several ops (a tied embedding and LM head, or one weight reused) becomes a
``TiedGroup`` the solver co-locates or copies.

The ops whose values the graph returns are ``Node.returned``. fxpipe does not trace
the loss, so its memory is an assumption (``LOSS_FACTORS``): like cross-entropy over
the returned logits, it saves one copy of its input for backward (log-softmax) and
its backward allocates one more (the gradient of log-softmax), each the size of the
returned values. With the returned values kept until the backward and their gradient
(``StageMemory.outputs``), that is 4 x the logits on the last stage, which is what
an H100 measured for GPT-2 small (1F1B, 4 stages).

A node's backward allocates gradients that live only while it runs (``Node.grad_bytes``:
its output's, its inputs' and its parameters', those that require grad). The same H100
run found ~300 MiB of them on the middle GPT-2 stages (a softmax over the attention
scores: their gradient and its input's, 96 MiB each per micro-batch). A view's backward
views its output's gradient, so it allocates no gradient for its input.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

import torch.fx

from fxpipe import meta
from fxpipe.cost_models import Device, allreduce_time, link_time
from fxpipe.partition.problem import Edge, Node, Problem, Recompute, TiedGroup, TiedPolicy
from fxpipe.partition.tensor_parallel import tensor_sharded
from fxpipe.passes.aliasing import aliases, is_view, mutated_input
from fxpipe.passes.base import OP_NODES
from fxpipe.passes.sequence_parallel import sequence_gaps, sequence_shards
from fxpipe.passes.tensor_parallel import annotate_tensor_parallel, shards
from fxpipe.runtime.recompute import KeepRule, Kept
from fxpipe.schedules import ScheduleKind
from fxpipe.tracing.export import running_stats

__all__ = ["LOSS_FACTORS", "OPTIMIZERS", "Lowered", "lower"]

# Bytes of parameter state per byte of fp32 parameter: weights + gradients + optimizer state.
OPTIMIZERS = {"adam": 4.0, "sgd": 2.0, "sgd-momentum": 3.0, "none": 1.0}

# The loss's (saved for backward, gradient in its backward) bytes per byte the graph
# returns: cross-entropy's log-softmax and its gradient (see the module docstring).
LOSS_FACTORS = (1, 1)
# The most keep levels a selective stage chooses from (``keep_levels``): each is a choice
# per stage in the CP-SAT program. Enough for a Llama's six (down projection, attention,
# key and value, query and output, gate and up, LM head).
MAX_KEEP_LEVELS = 8


@dataclass(frozen=True)
class Lowered:
    problem: Problem
    ops: tuple[torch.fx.Node, ...]  # problem node i is ops[i]
    params: dict[str, tuple[str, ...]]  # op node name -> canonical parameter names it reads


def lower(
    gm: torch.fx.GraphModule,
    *,
    num_stages: int,
    device: Device,
    memory_limit: float,
    schedule: ScheduleKind,
    microbatches: int,
    optimizer: str = "adam",
    recompute: Recompute = Recompute.AUTO,
    tied_policy: TiedPolicy = TiedPolicy.COPY,
    block_depth: int = 1,
    virtual_stages: int = 1,
    num_devices: int = 0,
    across_hosts: bool = False,
    tensor_parallel: int = 1,
    compute_efficiency: float = 1.0,
) -> Lowered:
    """The partition problem of ``gm`` (every node costed: run passes and a cost model first).
    ``across_hosts``: the stages send to each other over the link between hosts (a
    pipeline longer than a host, ``partition.layout``), not the link inside one.
    ``tensor_parallel``: t GPUs of a host split each op Megatron-LM's layout splits
    (``partition.tensor_parallel``), priced on the host's link. ``compute_efficiency``: the
    share of the cost model's speed a GPU reaches (``partition.layout.COMPUTE_EFFICIENCY``):
    every op's seconds are the cost model's divided by it; communication is not."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    ops = tuple(n for n in gm.graph.nodes if n.op in OP_NODES)
    index = {node: i for i, node in enumerate(ops)}
    reads = _parameter_reads(ops)
    readers, sizes = _readers(ops, reads)
    written = tuple(sorted({made for op in ops for made in meta.BYTES.get(op).writes_kept}))
    levels = keep_levels([kept for op in ops for kept in meta.BYTES.get(op).selective], written)
    # the model writes into every output selective recompute could keep: it has no level
    unusable = bool(written) and not levels
    levels = levels or ((0, 0),)
    nodes = _nodes(gm, ops, reads, readers, device=device, block_depth=block_depth,
                   levels=levels, skip=written, unusable=unusable, same_node=not across_hosts,
                   efficiency=compute_efficiency)
    order_edges, fused = _in_place_order(gm, ops, index)
    returned_bytes = sum(n.output_bytes for n in nodes if n.returned)
    problem = Problem(
        nodes=nodes,
        edges=_edges(ops, index, order_edges),
        num_stages=num_stages,
        memory_limit=memory_limit,
        schedule=schedule,
        microbatches=microbatches,
        state_factor=OPTIMIZERS[optimizer],
        recompute=recompute,
        keep_levels=levels,
        unkept=() if unusable else written,
        loss_saved_bytes=returned_bytes * LOSS_FACTORS[0],
        loss_grad_bytes=returned_bytes * LOSS_FACTORS[1],
        tied=_tied_groups(readers, sizes, device),
        tied_policy=tied_policy,
        colocate=(_colocated(gm, ops, index) + fused + _shared_state(gm, ops, index)
                  + _unpacked(ops, index)),
        virtual_stages=virtual_stages,
        num_devices=num_devices,
        allreduce_bandwidth=device.intra_node_bandwidth,
        allreduce_latency_s=device.intra_node_latency,
    )
    if tensor_parallel > 1:
        if not all(meta.SHARD.has(op) for op in ops):  # once per graph, not per layout
            annotate_tensor_parallel(gm)
        split = sequence_shards(ops, shards(ops, gm), sequence_gaps(gm).at(tensor_parallel))
        problem = tensor_sharded(
            problem, split, tensor_parallel, bandwidth=device.intra_node_bandwidth,
            latency_s=device.intra_node_latency,
            pipeline_latency_s=link_time(0, device, same_node=not across_hosts))
    return Lowered(problem, ops, {k: tuple(sorted(v)) for k, v in reads.items()})


def _parameter_reads(ops: tuple[torch.fx.Node, ...]) -> dict[str, dict[str, int]]:
    """Op node name -> {parameter name: bytes} of the parameters it reads: its own
    (call_module) and those of its get_attr inputs."""
    reads: dict[str, dict[str, int]] = {}
    for node in ops:
        owned = dict(meta.BYTES.get(node).params)
        for source in node.all_input_nodes:
            if source.op == "get_attr":
                owned.update(meta.BYTES.get(source).params)
        reads[node.name] = owned
    return reads


def _readers(
    ops: tuple[torch.fx.Node, ...], reads: dict[str, dict[str, int]]
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Per parameter, the indices of the ops that read it (in op order), and its bytes."""
    readers: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for i, node in enumerate(ops):
        for name, size in reads[node.name].items():
            readers.setdefault(name, []).append(i)
            sizes[name] = size
    return readers, sizes


def _nodes(
    gm: torch.fx.GraphModule,
    ops: tuple[torch.fx.Node, ...],
    reads: dict[str, dict[str, int]],
    readers: dict[str, list[int]],
    *,
    device: Device,
    block_depth: int,
    levels: Sequence[tuple[int, int]],
    skip: tuple[tuple[int, int], ...],
    unusable: bool,
    same_node: bool = True,
    efficiency: float = 1.0,
) -> tuple[Node, ...]:
    """One problem node per op, its costs read off the node records; a parameter is the
    bytes of the one op that reads it (several readers make it a tied group instead)."""
    returned = set(gm.graph.output_node().all_input_nodes)
    nodes = []
    for node in ops:
        own = sum(size for name, size in reads[node.name].items() if len(readers[name]) == 1)
        memory = meta.BYTES.get(node)
        time = _slower(meta.TIME.get(node), efficiency)
        kept_bytes, kept_s = _selective(memory.selective, time.forward_s, levels, skip)
        nodes.append(
            Node(
                name=node.name,
                forward_s=time.forward_s,
                backward_s=time.backward_s,
                param_bytes=own,
                activation_bytes=memory.saved_bytes,
                grad_bytes=_grad_bytes(gm, node, reads[node.name], returned=node in returned),
                output_bytes=memory.output_bytes,
                comm_s=link_time(memory.output_bytes, device, same_node=same_node),
                module=_block(meta.MODULE.get(node).path, block_depth),
                members=(node.name,),
                returned=node in returned,
                backward_weight_s=time.backward_weight_s,
                deferred_bytes=_deferred_bytes(node),
                selective_bytes=kept_bytes,
                selective_kept_s=kept_s,
                selective_host_s=_sac_host_s(node, time, device),
                writes_kept=bool(memory.writes_kept) and unusable,
            )
        )
    return tuple(nodes)


def _sac_host_s(node: torch.fx.Node, time: meta.TimeInfo, device: Device) -> float:
    """The seconds torch's SAC adds to a node's first run and its run again, recomputed
    selectively: each time what the host takes for it (``device.sac_dispatch``, as
    calibrated) beyond its forward, which hides the rest; none for a node that dispatches
    no op (its value is no tensor, or an item of a tuple)."""
    if node.target is operator.getitem or not meta.SHAPE.get(node).tensors:
        return 0.0
    return 2 * max(device.sac_dispatch * time.host_scale - time.forward_s, 0.0)


def _slower(time: meta.TimeInfo, efficiency: float) -> meta.TimeInfo:
    """``time`` at ``efficiency`` of the cost model's speed."""
    if efficiency == 1.0:
        return time
    return replace(time, forward_s=time.forward_s / efficiency,
                   backward_s=time.backward_s / efficiency,
                   backward_weight_s=time.backward_weight_s / efficiency)


def keep_levels(kept: Iterable[Kept], written: Collection[tuple[int, int]] = ()
                ) -> tuple[tuple[int, int], ...]:
    """The rules (``KeepRule``'s (work, width)) a selective stage of a model chooses from,
    its matmuls' and attention's outputs being ``kept``: ordered by the work per element it
    takes to run one again, the most first, and of equal work the narrowest first, each
    level keeps the outputs the one before keeps and the next (work, width) of them, and
    the last all ((0, 0)); at most MAX_KEEP_LEVELS, spread evenly over them from the first
    (the fewest bytes kept, which the most memory-bound stages need) to all. The outputs
    the model writes into in place (``written``: their (work, width)) are in none: every
    level's rule skips them (``Problem.unkept``). Empty where every one is written (or
    there is none)."""
    found = sorted({(k.work, k.width) for k in kept} - set(written),
                   key=lambda c: (-c[0], c[1]))
    if len(found) > MAX_KEEP_LEVELS:
        last, most = len(found) - 1, MAX_KEEP_LEVELS - 1
        found = [found[round(i * last / most)] for i in range(MAX_KEEP_LEVELS)]
    return (*found[:-1], (0, 0)) if found else ()


def _selective(kept: Sequence[Kept], forward_s: float, levels: Sequence[tuple[int, int]],
               skip: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A node's ``selective_bytes`` and ``selective_kept_s`` per keep level: what the
    level's rule keeps of its outputs, and the share of its forward that makes them (by
    FLOPs: work per element times elements, elements in proportion to the bytes)."""
    flops = sum(k.work * k.nbytes for k in kept)
    rules = [KeepRule(*level, skip) for level in levels]
    held = [[k for k in kept if rule.keeps(k.work, k.width)] for rule in rules]
    return (tuple(sum(k.nbytes for k in row) for row in held),
            tuple(forward_s * sum(k.work * k.nbytes for k in row) / flops if flops else 0.0
                  for row in held))


def _edges(
    ops: tuple[torch.fx.Node, ...],
    index: dict[torch.fx.Node, int],
    order_edges: list[tuple[int, int]],
) -> tuple[Edge, ...]:
    """The data edges between ops, then the in-place ordering edges that are not one."""
    data = sorted(
        {(index[node], index[user]) for node in ops for user in node.users if user in index}
    )
    carried = set(data)
    return tuple(Edge(src, dst) for src, dst in data) + tuple(
        Edge(src, dst, data=False) for src, dst in order_edges if (src, dst) not in carried
    )


def _tied_groups(
    readers: dict[str, list[int]], sizes: dict[str, int], device: Device
) -> tuple[TiedGroup, ...]:
    """A parameter read by several ops (a tied embedding and LM head, a reused weight)."""
    return tuple(
        TiedGroup(
            name=name,
            nodes=tuple(sorted(set(users))),
            param_bytes=sizes[name],
            allreduce_s=allreduce_time(
                sizes[name], 2, device.intra_node_bandwidth, device.intra_node_latency
            ),
        )
        for name, users in sorted(readers.items())
        if len(set(users)) > 1
    )


def _colocated(
    gm: torch.fx.GraphModule, ops: tuple[torch.fx.Node, ...], index: dict[torch.fx.Node, int]
) -> tuple[tuple[int, ...], ...]:
    """An in-place op stays with the op whose result it mutates, and with the views that
    lead to it from their base: across a cut that result (or base) reaches the next
    stage as a leaf that requires grad, which autograd cannot mutate."""
    return tuple(
        tuple(sorted(index[n] for n in (node, *chain)))
        for node in ops
        if (chain := _mutated_chain(gm, node, index))
    )


def _unpacked(ops: tuple[torch.fx.Node, ...], index: dict[torch.fx.Node, int]
              ) -> tuple[tuple[int, ...], ...]:
    """An op that returns a tuple or list read only by indexing it (``torch.split``, a
    no-grad region's body, a module's (output, weights)) stays with its indexing: a cut
    between them would send the whole tuple, which torch.distributed.pipelining cannot
    (it passes tensors), where a cut after them sends the tensors read, no more."""
    groups = []
    for node in ops:
        users = list(node.users)
        if users and all(user.op == "call_function" and user.target is operator.getitem
                         and user.args[0] is node and user in index for user in users):
            groups.append(tuple(sorted(index[n] for n in (node, *users))))
    return tuple(groups)


def _shared_state(
    gm: torch.fx.GraphModule, ops: tuple[torch.fx.Node, ...], index: dict[torch.fx.Node, int]
) -> tuple[tuple[int, ...], ...]:
    """The ops that use one piece of state that the forward changes, kept on one stage:
    every reader of a parameter or buffer some op writes in place (BatchNorm's running
    statistics, which ``aten.batch_norm`` updates: ``running_stats``), and every call of a
    module in training mode that holds buffers. Split over stages, such a module called
    twice per micro-batch updates its statistics in another order than the model (the
    first call for every micro-batch, then the second), and on separate GPUs each stage
    would keep its own copy."""
    written: set[str] = set()
    users: dict[str, set[int]] = {}
    for op in ops:
        writes = {mutated_input(gm, op), *running_stats(op)}
        for arg, source in _arguments(op):
            if source.op != "get_attr":
                continue
            users.setdefault(str(source.target), set()).add(index[op])
            if source in writes or (arg is not None and arg.alias_info is not None
                                    and arg.alias_info.is_write):
                written.add(str(source.target))
        module = gm.get_submodule(str(op.target)) if op.op == "call_module" else None
        if module is not None and module.training and any(True for _ in module.buffers()):
            users.setdefault(f"module:{op.target}", set()).add(index[op])
            written.add(f"module:{op.target}")
    return tuple(tuple(sorted(users[name])) for name in sorted(written) if len(users[name]) > 1)


def _arguments(op: torch.fx.Node) -> list[tuple[torch._C.Argument | None, torch.fx.Node]]:
    """``op``'s node arguments, each with its schema argument where the op has one (an
    aten op), else None."""
    schema = getattr(op.target, "_schema", None) if op.op == "call_function" else None
    named = {a.name: a for a in schema.arguments} if schema is not None else {}
    positional = list(schema.arguments) if schema is not None else []
    found: list[tuple[torch._C.Argument | None, torch.fx.Node]] = []
    for i, value in enumerate(op.args):
        arg = positional[i] if i < len(positional) else None
        found += [(arg, n) for n in _nodes_in(value)]
    for key, value in op.kwargs.items():
        found += [(named.get(key), n) for n in _nodes_in(value)]
    return found


def _nodes_in(value: torch.fx.node.Argument) -> list[torch.fx.Node]:
    nodes: list[torch.fx.Node] = []

    def keep(node: torch.fx.Node) -> torch.fx.Node:
        nodes.append(node)
        return node

    torch.fx.map_arg(value, keep)
    return nodes


def _grad_bytes(gm: torch.fx.GraphModule, node: torch.fx.Node, params: dict[str, int], *,
                returned: bool) -> int:
    """Gradient bytes alive while ``node`` runs backward (see the module docstring): none
    if its output needs no gradient; its output's unless returned (the loss's backward
    makes that one, ``Problem.loss_grad_bytes``); its inputs' unless it is a view; and its
    trainable parameters' (accumulating a micro-batch's into ``.grad`` needs a copy)."""
    shape = meta.SHAPE.get(node)
    if not shape.requires_grad:
        return 0
    total = 0 if returned else _grad_nbytes(shape)
    if not is_view(node):
        total += sum(_grad_nbytes(meta.SHAPE.get(source)) for source in node.all_input_nodes
                     if source.op != "get_attr")
    total += sum(size for name, size in params.items() if gm.get_parameter(name).requires_grad)
    return total


def _deferred_bytes(node: torch.fx.Node) -> int:
    """What the weight gradient (W) of ``node`` keeps alive after its input gradient (B)
    ran: the activations it reads (a linear's X, for dW = dY^T X), none if it has no
    weight gradient. The memory pass charges a saved input to its producer; this is the
    same bytes seen from the op that needs them, to keep them for the deferred W."""
    if not meta.FLOPS.get(node).backward_weight:
        return 0
    return sum(meta.SHAPE.get(source).nbytes for source in node.all_input_nodes
               if source.op != "get_attr")


def _grad_nbytes(value: meta.ValueInfo) -> int:
    return sum(t.nbytes for t in value.tensors if t.requires_grad)


def _block(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def _in_place_order(
    gm: torch.fx.GraphModule, ops: tuple[torch.fx.Node, ...], index: dict[torch.fx.Node, int]
) -> tuple[list[tuple[int, int]], tuple[tuple[int, ...], ...]]:
    """Ordering edges and fused groups that keep every in-place op where the graph has it
    relative to the other readers of the storage it writes.

    The graph has no edge between ``x.mul_(2)`` and a later ``l1(x)`` (both read ``x``),
    nor between an earlier reader of ``h`` and ``h.relu_()``, so without these a cut could
    move a reader to the wrong side of the write. A reader of the old value (before the
    op in graph order) gets an edge to the op: it runs in the same or an earlier stage.
    A reader of the new value gets an edge from the op; when the storage is a graph
    input it is fused with the op instead, because the runner hands every stage the
    input as the caller passed it, not as another stage mutated it. Readers are the
    users of the storage's base and of every view or in-place result of it.
    """
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    edges: set[tuple[int, int]] = set()
    fused: list[tuple[int, ...]] = []
    for op in ops:
        base = mutated_input(gm, op)
        if base is None:
            continue
        while is_view(base) and base.args and isinstance(base.args[0], torch.fx.Node):
            base = base.args[0]
        shared = aliases(gm, base)
        readers = {user for alias in shared for user in alias.users
                   if user in index and user is not op}
        readers.update(alias for alias in shared if alias in index and alias is not op)
        after: list[int] = []
        for reader in sorted(readers, key=position.__getitem__):
            if position[reader] < position[op]:
                edges.add((index[reader], index[op]))
            elif base.op == "placeholder":
                after.append(index[reader])
            else:
                edges.add((index[op], index[reader]))
        if after:
            fused.append(tuple(sorted({index[op], *after})))
    return sorted(edges), tuple(fused)


def _mutated_chain(
    gm: torch.fx.GraphModule, node: torch.fx.Node, index: dict[torch.fx.Node, int]
) -> list[torch.fx.Node]:
    """The op nodes whose storage ``node`` writes in place: the input it mutates and,
    when that is a view, the views back to their base (empty if ``node`` is not in place)."""
    chain: list[torch.fx.Node] = []
    source = mutated_input(gm, node)
    while source is not None and source in index:
        chain.append(source)
        first = source.args[0] if source.args else None
        source = first if is_view(source) and isinstance(first, torch.fx.Node) else None
    return chain
