"""Random numbers in a stage split over t ranks (tensor parallelism): a dropout on this
rank's own share of a pair (its heads, its slice of the MLP) draws its own mask, a
dropout on a value every rank holds whole draws the same mask on every rank.

# t: the TP degree; s: a seed drawn from the random state every rank of the split shares.

The unsplit model draws one mask over all the heads; split, each rank holds 1/t of them,
and were every rank to draw from the same state, head h of rank 0 and head h of rank 1
would get the same mask: correlated, unlike the model. Megatron-LM keeps two random
states for this (its "model-parallel RNG tracker": the default one, the same on every
rank, and a tensor-parallel one seeded per rank, which a dropout on a share forks into);
torch's DTensor offsets one shared state by each shard's place (on GPUs only). Here one
state is kept, the default one, the same on the t ranks (``same_random_state``, when the
stage is split), and a dropout on a share runs under a state derived from it and the
rank::

    default state (same on every rank) ── draw s ──► the default state moves on alike
                                            │
                  rank k's dropout runs seeded with (s, k), then the default state is back

so that what runs between stays a function of the shared state alone: a replicated
dropout after it draws alike on every rank, and a recomputed forward
(``torch.utils.checkpoint``, which restores the default states) draws the same masks
again, with no state of its own to save.

The stage's code brackets each random op on a share (``codegen/local_shards.py`` writes
the calls): ``tp_own_random(x, mesh)`` before it, ``tp_shared_random(y, mesh)`` after;
both return their value unchanged, and with ``mesh`` None (the stage run whole) do
nothing.
"""

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_tensor

__all__ = ["same_random_state", "tp_own_random", "tp_shared_random"]

# the default states a ``tp_own_random`` set aside, put back by its ``tp_shared_random``
# (the two are written next to each other around one op, so at most one is held)
_SET_ASIDE: list[tuple[torch.Tensor, torch.device | None, torch.Tensor | None]] = []
_SEEDS = 2**62  # the range a seed s is drawn from
_MIX = 0x9E3779B97F4A7C15  # spreads the ranks' seeds (s, k) apart (the golden ratio, 64 bits)


def tp_own_random(value: Any, mesh: DeviceMesh | None) -> Any:
    """``value`` unchanged; the random op run next, on this rank's share, draws from a
    state of this rank's own (see the module's docstring)."""
    if mesh is None:
        return value
    device = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
    gpu = device if device.type == "cuda" else None
    s = int(torch.randint(_SEEDS, (), dtype=torch.int64))  # moves the shared state on
    _SET_ASIDE.append((torch.get_rng_state(), gpu,
                       torch.cuda.get_rng_state(gpu) if gpu is not None else None))
    own = (s ^ (mesh.get_local_rank() + 1) * _MIX) % _SEEDS
    torch.random.default_generator.manual_seed(own)
    if gpu is not None:
        torch.cuda.default_generators[gpu.index or 0].manual_seed(own)
    return value


def tp_shared_random(value: Any, mesh: DeviceMesh | None) -> Any:
    """``value`` unchanged; the state a ``tp_own_random`` set aside is the default one
    again, the same on every rank of the split."""
    if mesh is None:
        return value
    cpu, gpu, gpu_state = _SET_ASIDE.pop()
    torch.set_rng_state(cpu)
    if gpu is not None and gpu_state is not None:
        torch.cuda.set_rng_state(gpu_state, gpu)
    return value


def same_random_state(mesh: DeviceMesh) -> None:
    """Give every rank of ``mesh`` the random state of its first (collective): what the
    split stage draws on values held whole must be alike on every rank, else the copies
    drift apart, even where a training script seeded each rank its own way."""
    device = torch.device(mesh.device_type)
    states: list[tuple[torch.Tensor, torch.device | None]] = [(torch.get_rng_state(), None)]
    if device.type == "cuda":
        here = torch.device("cuda", torch.cuda.current_device())
        states.append((torch.cuda.get_rng_state(here), here))
    for state, gpu in states:
        shared = distribute_tensor(state.to(device), mesh, [Replicate()]).to_local().cpu()
        if gpu is None:
            torch.set_rng_state(shared)
        else:
            torch.cuda.set_rng_state(shared, gpu)
