"""Tensor parallelism inside a host: each stage split over t ranks as Megatron-LM splits
it, on torch's DTensor.

# pp: ranks per pipeline, d: pipelines, t: ranks splitting each stage (the TP degree).

The job's d · pp · t ranks sit on a 3-D ``DeviceMesh`` ("dp", "pp", "tp"), tp innermost
so that a stage's t ranks share a host: job rank (i · pp + j) · t + k is rank k of the
split of pipeline i's rank j. Rank k of a stage receives whole values from rank k of the
stage before it (its pp sub-mesh) and sends whole values on::

    tp 0 | rank 0 (stage 0) ──► rank 2 (stage 1)
    tp 1 | rank 1 (stage 0) ──► rank 3 (stage 1)
           └ tp sub-mesh ┘      └ tp sub-mesh ┘     DTensor's collectives run inside each

The plan's ``TENSOR_PARALLEL`` says per stage which parameters split along which dim (a
column-parallel linear's weight by its rows, a row-parallel one's by its columns, a
vocabulary-parallel embedding's and LM head's by the vocabulary; a fused qkv's as
``(dim, parts)``, its rows reordered so that each rank holds its share of every part,
[q_r | k_r | v_r]: ``fused_order``); every other parameter and buffer is a replicated
DTensor. The stage is written for t (``fxpipe/codegen/local_shards.py``): between a
pair's column and row linears each rank runs its share on plain tensors, with sizes read
as shares of ``stage.tp``, which ``split_stage`` sets; ``tp_share`` takes a column's
output as this rank's share, ``tp_whole`` a replicated value read between as a plain
tensor, ``tp_joined`` the row's input back as the ``Shard`` DTensor it is a share of, and
``tp_replicated`` the row's partial sums all-reduced where it makes them (left to torch's
sharding rules they may be reduce-scattered into a residual stream that stays split by
width, gathered at every norm). Between the pairs (sequence parallelism, Megatron-LM's),
``tp_tokens`` puts a row's partial sums on each rank's share of the tokens (a
reduce-scatter: the other half of the pair's all-reduce is ``tp_replicated``'s
all-gather where the next columns read the stream) and cuts whole values entering those
ops to the rank's tokens (no collective). A pair the codegen could not follow runs as
written on DTensors
with the model's global shapes (correct; its attention whole on every rank). Received
values enter as replicated DTensors (their gradients summed over the t ranks in the
backward, the column-parallel pair's all-reduce); sent values leave whole
(``full_tensor``: partial sums all-reduced, split values gathered), and so does the
model's output but for values split along their last dim (a vocabulary-parallel LM
head's logits): those reach the loss split, which runs under torch's ``loss_parallel``
(a cross-entropy over the vocabulary's shards, each rank's logits never gathered) and
gives a plain loss (``whole_loss``). Tensors the stage makes itself
(positions, masks) count as replicated (torch's ``implicit_replication``) in the step's
forward and backward.
"""

import contextlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

from .data_parallel import make_mesh
from .tp_random import same_random_state

__all__ = ["counted_here", "fused_order", "settle_grads", "split_stage", "tensor_mesh",
           "tensor_step", "tp_joined", "tp_replicated", "tp_share", "tp_tokens", "tp_whole",
           "unfused"]

# a parameter's split: the dim, or (the dim, the sizes of the parts laid end to end along
# it, as a fused qkv's q, k and v), which each rank takes its share of
Split = int | tuple[int, tuple[int, ...]]


def tensor_mesh(device: torch.device | str, dp: int, pp: int, tp: int) -> DeviceMesh:
    """The job's ranks as a ``DeviceMesh`` ("dp", "pp", "tp"), tp innermost; with t = 1
    data_parallel.py's ("dp", "pp") (collective: every rank calls it)."""
    if tp == 1:
        return make_mesh(device, dp, pp)
    return init_device_mesh(torch.device(device).type, (dp, pp, tp),
                            mesh_dim_names=("dp", "pp", "tp"))


def split_stage(stage: nn.Module, shards: Mapping[str, Split], mesh: DeviceMesh,
                last: bool = False) -> None:
    """Make every parameter and buffer of ``stage`` a DTensor on ``mesh`` (the stage's
    1-D tp sub-mesh): split along dim ``shards[name]`` where its name is there, else
    replicated, one DTensor per original tensor (ties inside the stage stay ties); and
    make ``stage``'s forward take and give whole tensors (collective over ``mesh``).

    A fused parameter's rows are reordered first (``fused_order``) so that rank r's shard
    is its share of each part, [q_r | k_r | v_r]: the stage's local code splits it as the
    whole splits [q | k | v]. ``stage.tp_fused`` keeps the order (``unfused`` undoes it),
    and ``stage.tp`` and ``stage.tp_mesh`` are what the stage's local code reads."""
    made: dict[int, torch.Tensor] = {}
    t = mesh.size()
    fused = {name: split for name, split in shards.items() if isinstance(split, tuple)}
    for prefix, module in stage.named_modules(remove_duplicate=False):
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for key, value in table.items():
                if value is None or isinstance(value, DTensor):
                    continue
                if id(value) not in made:
                    name = f"{prefix}.{key}" if prefix else key
                    split = shards.get(name)
                    dim = split[0] if isinstance(split, tuple) else split
                    placement = Replicate() if dim is None else Shard(dim)
                    whole = value.detach()
                    if isinstance(split, tuple):
                        whole = whole.index_select(dim, torch.tensor(
                            fused_order(split[1], t), device=whole.device))
                    made_split = distribute_tensor(whole, mesh, [placement])
                    made[id(value)] = (nn.Parameter(made_split, requires_grad=value.requires_grad)
                                       if is_param else made_split)
                table[key] = made[id(value)]
    vars(stage).update(tp=t, tp_mesh=mesh, tp_fused=fused)  # plain attributes
    same_random_state(mesh)  # a dropout on whole values draws alike on every rank
    stage.forward = _whole_at_the_edges(stage.forward, mesh, last)


def fused_order(parts: Sequence[int], t: int) -> list[int]:
    """The order of a fused dim's indices that puts each rank's share of every part
    together: parts (q, k, v) over t = 2 as [q_0 | k_0 | v_0 | q_1 | k_1 | v_1]."""
    order: list[int] = []
    for rank in range(t):
        start = 0
        for size in parts:
            share = size // t
            order += range(start + rank * share, start + (rank + 1) * share)
            start += size
    return order


def unfused(stage: nn.Module, name: str, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` (a gathered parameter of ``stage``, or its gradient) in the model's order,
    where ``split_stage`` reordered it."""
    split = vars(stage).get("tp_fused", {}).get(name)
    if split is None:
        return whole
    dim, parts = split
    order = torch.tensor(fused_order(parts, vars(stage)["tp"]), device=whole.device)
    return whole.index_select(dim, torch.argsort(order))


# What a stage written for t ranks calls between a column-parallel op and its row-parallel
# partner (``fxpipe/codegen/local_shards.py`` writes the calls): the ops between run on
# plain tensors of this rank's share; each is the identity on a stage run whole.


def tp_share(value: Any) -> Any:
    """A column-parallel op's output as this rank's share of its last dim, a plain tensor
    (its gradient re-enters as that share)."""
    if not isinstance(value, DTensor):
        return value
    split = Shard(value.dim() - 1)
    if value.placements != (split,):
        value = value.redistribute(value.device_mesh, [split])
    return value.to_local()


def tp_whole(value: Any) -> Any:
    """A replicated value the ops between a pair read (a mask, rotary cos and sin) as a
    plain tensor; its gradient, different on each rank (each its own heads'), is summed
    over the ranks (``Partial``) where it leaves."""
    if not isinstance(value, DTensor):
        return value
    whole = [Replicate()] * value.device_mesh.ndim
    if list(value.placements) != whole:
        value = value.redistribute(value.device_mesh, whole)
    return value.to_local(grad_placements=[Partial()] * value.device_mesh.ndim)


def tp_replicated(value: Any) -> Any:
    """``value`` whole on every rank: a row's partial sums all-reduced where it makes
    them; values split by tokens gathered where they leave the ops per token (sequence
    parallelism: for the next columns); a token embedding's lookups split by width,
    gathered whole once where they are made (the plan's one collective for the
    embedding). Left to themselves, torch's sharding rules could keep the residual
    stream split by width, gathering it at every norm and column and reduce-scattering
    every row's sum, which the plan does not price."""
    if not isinstance(value, DTensor):
        return value
    return value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)


def tp_tokens(value: Any, dim: int) -> Any:
    """``value`` split along token dim ``dim`` over the ranks (sequence parallelism): a
    row's partial sums reduce-scattered (the pair's all-reduce, half of it here, the
    other half where the ops per token end and ``tp_replicated`` gathers them), a whole
    value cut to this rank's tokens (no collective)."""
    if not isinstance(value, DTensor):
        return value
    return value.redistribute(value.device_mesh, [Shard(dim)] * value.device_mesh.ndim)


def tp_joined(value: Any, dim: int, mesh: DeviceMesh | None) -> Any:
    """This rank's share (along ``dim``) of what a row-parallel op reads, as the DTensor it
    is a shard of: the op's partial sums are all-reduced by DTensor where they meet whole
    values (the pair's one all-reduce). ``mesh`` None: the stage runs whole."""
    if mesh is None:
        return value
    return DTensor.from_local(value, mesh, [Shard(dim)], run_check=False)


def _whole_at_the_edges(forward: Callable[..., Any], mesh: DeviceMesh, last: bool
                        ) -> Callable[..., Any]:
    """``forward`` taking whole tensors (replicated DTensors inside) and giving whole ones;
    an op DTensor has no rule for is refused in one line (a ``ValueError``)."""
    def split_forward(**inputs: Any) -> Any:
        entered = {name: DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                   if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                   for name, x in inputs.items()}
        try:
            outputs = forward(**entered)
        except NotImplementedError as error:
            found = re.search(r"Operator (\S+) does not have a sharding strategy", str(error))
            if found is None:
                raise
            raise ValueError(
                f"torch's DTensor has no sharding rule for {found[1]}, which this stage runs: "
                f"tensor parallelism cannot split it; split again with --tp 1") from None
        return tuple(x.full_tensor() if isinstance(x, DTensor) and not (
            last and x.placements == (Shard(x.dim() - 1),)) else x for x in outputs)
    return split_forward


def tensor_step(tp: int, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The context of a step's forward and backward: with t > 1, tensors a split stage
    makes itself count as replicated, and on the CPU attention runs as its math (matmuls
    and a softmax): torch's CPU kernel for it has no DTensor sharding rule."""
    if tp == 1:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(implicit_replication())
    stack.enter_context(loss_parallel())
    if device.type == "cpu":
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    return stack


def whole_loss(loss_fn: Callable[..., Any] | None, tp: int) -> Callable[..., Any] | None:
    """``loss_fn`` giving a plain tensor where it gives a DTensor (a loss computed on the
    last stage's split logits): a copy, not a view of the DTensor's, which torch's
    zero-bubble schedules detach in place. None (the model's own loss, which leaves its
    stage whole) stays None."""
    if tp == 1 or loss_fn is None:
        return loss_fn

    def loss(*args: Any) -> Any:
        value = loss_fn(*args)
        return value.full_tensor().clone() if isinstance(value, DTensor) else value
    return loss


def counted_here(tensor: torch.Tensor) -> bool:
    """Whether this rank counts ``tensor``'s local part in a sum over the job (a norm):
    a DTensor's only where it is the first copy along every mesh dim it is replicated on,
    so each of its shards counts once."""
    if not isinstance(tensor, DTensor):
        return True
    mesh = tensor.device_mesh
    return all(mesh.get_local_rank(i) == 0 for i, p in enumerate(tensor.placements)
               if p.is_replicate())


def settle_grads(params: Iterable[nn.Parameter]) -> None:
    """Give each split parameter's gradient its parameter's placement (torch's rules may
    leave one as partial sums or split otherwise), so that every rank's local gradient
    is its own shard's: tied copies are summed shard by shard, and the optimizer steps
    each shard with its own gradient."""
    for param in params:
        grad = param.grad
        if isinstance(param, DTensor) and isinstance(grad, DTensor) and (
                grad.placements != param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)
