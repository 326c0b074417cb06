"""fxpipe.runtime.tensor_parallel on one gloo rank (a tp sub-mesh of 1): a stage's
parameters and buffers become DTensors as the table says, its forward takes and gives
plain tensors, its gradients reach the received values and the parameters as the plain
module's do, and what a norm counts. The runs on several ranks are
tests/distributed/test_tensor_parallel_torchrun.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fxpipe.runtime.tensor_parallel import (
    counted_here,
    fused_order,
    settle_grads,
    split_stage,
    tensor_mesh,
    tensor_step,
    tp_joined,
    tp_share,
    tp_tokens,
    tp_whole,
    unfused,
    whole_loss,
)


@pytest.fixture
def one_rank():  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Stage(nn.Module):
    """A generated stage's shape: inputs by name, a tuple out, a buffer, a made tensor."""

    INPUTS = ("x",)
    OUTPUTS = ("y", "z")

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((4,), 2.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.down(torch.relu(self.up(x))) * self.scale
        return y, y + torch.arange(4, dtype=y.dtype)  # a tensor the stage makes itself


def test_a_split_stage_runs_as_the_plain_one(one_rank: None) -> None:
    torch.manual_seed(0)
    plain = _Stage().double()
    split = _Stage().double()
    split.load_state_dict(plain.state_dict())
    mesh = tensor_mesh("cpu", 1, 1, 1)
    assert mesh.mesh_dim_names == ("dp", "pp")  # t = 1: the data-parallel mesh as before
    tp = dist.device_mesh.init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    split_stage(split, {"up.weight": 0, "up.bias": 0, "down.weight": 1}, tp["tp"])
    assert split.up.weight.placements == (Shard(0),)
    assert split.down.weight.placements == (Shard(1),)
    assert split.down.bias.placements == (Replicate(),)
    assert isinstance(split.scale, DTensor) and split.scale.placements == (Replicate(),)
    x = torch.randn(3, 4, dtype=torch.float64)
    wants = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outputs = []
    for module, given in zip((plain, split), wants, strict=True):
        with tensor_step(2, torch.device("cpu")):  # as a step with t > 1 runs it
            y, z = module(x=given)
            (y.sum() + (z * z).sum()).backward()
        outputs.append((y, z))
    for got, want in zip(outputs[1], outputs[0], strict=True):
        assert type(got) is torch.Tensor and torch.equal(got, want)
    assert torch.equal(wants[1].grad, wants[0].grad)
    settle_grads(split.parameters())
    for (name, got), want in zip(split.named_parameters(), plain.parameters(), strict=True):
        assert got.grad.placements == got.placements, name
        assert torch.allclose(got.grad.full_tensor(), want.grad, rtol=0, atol=1e-14), name
    assert counted_here(split.up.weight.grad) and counted_here(split.down.bias.grad)
    assert counted_here(torch.ones(1))


class _Renorm(nn.Module):
    INPUTS = ("x",)
    OUTPUTS = ("y",)

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.up(x).renorm(2, 0, 1.0),)


def test_an_op_without_a_sharding_rule_is_refused_in_one_line(one_rank: None) -> None:
    stage = _Renorm()
    tp = dist.device_mesh.init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    split_stage(stage, {"up.weight": 0}, tp["tp"])
    with pytest.raises(ValueError, match=r"^torch's DTensor has no sharding rule for "
                       r"aten\.renorm\.default, which this stage runs: tensor parallelism "
                       r"cannot split it; split again with --tp 1$"):
        stage(x=torch.randn(2, 4))


class _Head(nn.Module):
    INPUTS = ("x",)
    OUTPUTS = ("logits",)

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 10, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.head(x),)


def test_the_last_stage_keeps_its_logits_split_for_a_parallel_loss(one_rank: None) -> None:
    """A vocabulary-parallel head's logits (split along their last dim) leave the last
    stage as a DTensor, and the loss on them, under the step's loss_parallel, is a plain
    tensor equal to the plain head's, with its gradients; another stage gathers them."""
    torch.manual_seed(0)
    plain = _Head().double()
    tp = dist.device_mesh.init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    x, target = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 10, (6,))
    loss_fn = whole_loss(torch.nn.functional.cross_entropy, 2)
    grads = []
    for last in (True, False):
        split = _Head().double()
        split.load_state_dict(plain.state_dict())
        split_stage(split, {"head.weight": 0}, tp["tp"], last=last)
        with tensor_step(2, torch.device("cpu")):
            (logits,) = split(x=x)
            assert isinstance(logits, DTensor) is last
            loss = loss_fn(logits, target)
            loss.backward()
        assert type(loss) is torch.Tensor and (loss._base is None or not last)  # no view
        grads.append(split.head.weight.grad.full_tensor())
    want = torch.nn.functional.cross_entropy(plain(x=x)[0], target)
    want.backward()
    assert torch.allclose(loss, want, rtol=0, atol=1e-15)
    for got in grads:
        assert torch.allclose(got, plain.head.weight.grad, rtol=0, atol=1e-15)


@pytest.mark.parametrize(("parts", "t"), [((8, 8, 8), 2), ((8, 4, 4), 4), ((6,), 3)])
def test_a_fused_dim_splits_into_each_ranks_share_of_every_part_and_back(
        parts: tuple[int, ...], t: int) -> None:
    """A fused qkv's rows reordered by fused_order and cut into t equal shards give rank r
    its share of q, of k and of v, in that order (its heads of each; GQA's k and v
    narrower than q); gathering the shards and undoing the order (unfused) gives the
    model's rows back, on either dim (an (in, out) Conv1D weight splits dim 1)."""
    rows = torch.arange(sum(parts) * 3, dtype=torch.float64).reshape(sum(parts), 3)
    order = fused_order(parts, t)
    assert sorted(order) == list(range(sum(parts)))
    shards = rows[order].chunk(t)
    starts = [sum(parts[:i]) for i in range(len(parts))]
    for rank, shard in enumerate(shards):
        want = torch.cat([rows[start + rank * (size // t):start + (rank + 1) * (size // t)]
                          for start, size in zip(starts, parts, strict=True)])
        assert torch.equal(shard, want), rank
    stage = nn.Module()
    stage.tp, stage.tp_fused = t, {"qkv.weight": (0, parts), "conv.weight": (1, parts)}
    assert torch.equal(unfused(stage, "qkv.weight", torch.cat(shards)), rows)
    assert torch.equal(unfused(stage, "conv.weight", rows[order].T), rows.T)
    assert unfused(stage, "other", rows) is rows


def test_the_local_helpers_pass_plain_tensors_through(one_rank: None) -> None:
    """On a stage run whole (t = 1, no mesh) tp_share, tp_whole and tp_joined change
    nothing; on a DTensor they give its local share and take it back."""
    x = torch.randn(2, 4, dtype=torch.float64)
    assert tp_share(x) is x and tp_whole(x) is x and tp_joined(x, 1, None) is x
    mesh = dist.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    split = DTensor.from_local(x, mesh, [Shard(1)])
    assert type(tp_share(split)) is torch.Tensor and torch.equal(tp_share(split), x)
    assert torch.equal(tp_whole(DTensor.from_local(x, mesh, [Replicate()])), x)
    joined = tp_joined(x, 1, mesh)
    assert joined.placements == (Shard(1),) and torch.equal(joined.to_local(), x)


def test_tp_tokens_puts_a_value_on_its_share_of_the_tokens(one_rank: None) -> None:
    """Sequence parallelism: a row's partial sums (``Partial``) and a whole value
    (``Replicate``) both become ``Shard`` along the token dim asked; a plain tensor (the
    stage run whole) is left as it is."""
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    assert tp_tokens(x, 1) is x
    mesh = dist.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    for placement in (Partial(), Replicate()):
        cut = tp_tokens(DTensor.from_local(x, mesh, [placement]), 1)
        assert cut.placements == (Shard(1),) and torch.equal(cut.full_tensor(), x)
