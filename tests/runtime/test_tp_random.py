"""fxpipe.runtime.tp_random in one process (a stand-in for a rank's tp mesh): a dropout
between ``tp_own_random`` and ``tp_shared_random`` draws a mask of its rank's own, the
shared state moves on alike on every rank, and ``torch.utils.checkpoint``'s recomputed
forward draws the same mask again. The runs on several ranks are
tests/distributed/test_tensor_parallel_torchrun.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from fxpipe.runtime.tp_random import same_random_state, tp_own_random, tp_shared_random


class _Rank:
    """What the helpers read of a tp mesh: this rank's place on it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def get_local_rank(self) -> int:
        return self.rank


def _dropped(x: torch.Tensor, mesh: object) -> torch.Tensor:
    """A dropout on a share, as a split stage's code writes it."""
    return tp_shared_random(torch.nn.functional.dropout(tp_own_random(x, mesh), 0.5), mesh)


def test_each_rank_draws_its_own_mask_and_the_shared_state_moves_on_alike() -> None:
    x = torch.ones(64, 64, dtype=torch.float64)
    masks, after = [], []
    for rank in (0, 1):
        torch.manual_seed(7)
        masks.append(_dropped(x, _Rank(rank)) != 0)
        after.append(torch.rand(8))  # what a replicated dropout after it would draw
    assert not torch.equal(masks[0], masks[1])
    assert 0.4 < float(masks[0].double().mean()) < 0.6  # a dropout's mask, not a constant
    assert torch.equal(after[0], after[1])
    torch.manual_seed(7)
    assert torch.equal(_dropped(x, _Rank(0)) != 0, masks[0])  # a function of the state


def test_without_a_mesh_the_helpers_do_nothing() -> None:
    torch.manual_seed(3)
    x = torch.randn(4)
    state = torch.get_rng_state()
    assert tp_own_random(x, None) is x and tp_shared_random(x, None) is x
    assert torch.equal(torch.get_rng_state(), state)


def test_a_recomputed_forward_draws_the_mask_of_the_first() -> None:
    """Under torch.utils.checkpoint (the torchrun path's recompute) the backward reruns the
    forward from the random state it saved: the gradient is zero exactly where the
    forward's mask dropped."""
    torch.manual_seed(11)
    x = torch.ones(32, 32, dtype=torch.float64, requires_grad=True)
    y = checkpoint(_dropped, x, _Rank(1), use_reentrant=False)
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad != 0, y.detach() != 0)


def test_the_ranks_of_a_mesh_take_the_state_of_its_first() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        torch.manual_seed(5)
        state = torch.get_rng_state()
        same_random_state(mesh)
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        dist.destroy_process_group()
