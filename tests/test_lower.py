"""lower(): which ops the model returns, the loss's default memory, backward gradients."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from fxpipe.compiler import analyze
from fxpipe.cost_models import get_device
from fxpipe.frontend import trace
from fxpipe.lower import LOSS_FACTORS, MAX_KEEP_LEVELS, keep_levels, lower
from fxpipe.runtime.recompute import Kept
from fxpipe.schedules import ScheduleKind


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.body(x))
        return {"logits": self.head(h), "hidden": h}


def test_returned_ops_and_default_loss_bytes() -> None:
    traced = trace(TwoHeads(), (torch.randn(4, 8),))
    device = get_device("h100")
    analyze(traced, device=device)
    lowered = lower(traced.gm, num_stages=2, device=device, memory_limit=float("inf"),
                    schedule=ScheduleKind.ONE_F_ONE_B, microbatches=2)
    p = lowered.problem
    returned = {n.name: n.output_bytes for n in p.nodes if n.returned}
    assert returned == {"head": 4 * 5 * 4, "relu": 4 * 16 * 4}
    assert not any(n.returned for n in p.nodes if n.name not in returned)
    total = sum(returned.values())
    assert (p.loss_saved_bytes, p.loss_grad_bytes) == (total * LOSS_FACTORS[0],
                                                       total * LOSS_FACTORS[1])


class Masked(nn.Module):
    """A frozen layer, one that trains, a softmax, a view, and a mask needing no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (self.frozen(x) > 0).float()
        y = self.fc(x).softmax(-1)
        return y.view(4, 4, 4) * mask.view(4, 4, 2).repeat(1, 1, 2)


def test_grad_bytes_count_what_each_backward_allocates() -> None:
    traced = trace(Masked(), (torch.randn(4, 8),))
    device = get_device("h100")
    analyze(traced, device=device)
    p = lower(traced.gm, num_stages=1, device=device, memory_limit=float("inf"),
              schedule=ScheduleKind.ONE_F_ONE_B, microbatches=1).problem
    grad = {n.name: n.grad_bytes for n in p.nodes}
    value = 4 * 16 * 4  # bytes of every (4, 16) float value below
    # no gradient flows through the mask, and the frozen layer's weights need none
    assert grad["frozen"] == grad["gt"] == grad["float_1"] == grad["view_1"] == 0
    assert grad["repeat"] == 0
    # fc's output gradient and its parameters' (its input x needs none)
    assert grad["fc"] == value + (16 * 8 + 16) * 4
    # softmax: its output's gradient and its input's
    assert grad["softmax"] == 2 * value
    # a view's backward views its output's gradient: nothing for the input
    assert grad["view"] == value
    # the returned product: the loss's backward made its output's gradient; y's is new
    assert grad["mul"] == value


def test_backward_splits_into_input_and_weight_parts_down_to_the_plan() -> None:
    """The linears' weight gradients (W) reach the problem nodes and the plan's stages;
    the relu has no weights, so its backward is all input gradient (B)."""
    from fxpipe.compiler import SplitOptions, plan_split

    traced = trace(TwoHeads(), (torch.randn(4, 8),))
    device = get_device("h100")
    analyze(traced, device=device)
    p = lower(traced.gm, num_stages=2, device=device, memory_limit=float("inf"),
              schedule=ScheduleKind.ONE_F_ONE_B, microbatches=2).problem
    by_name = {n.name: n for n in p.nodes}
    head, body = by_name["head"], by_name["body"]
    assert 0 < head.backward_weight_s < head.backward_s
    assert head.deferred_bytes == 4 * 16 * 4, "the relu's output, the head's X"
    # the data input needs no gradient: the first linear's backward is its weights' alone
    assert body.backward_weight_s == body.backward_s > 0
    assert by_name["relu"].backward_weight_s == 0 and by_name["relu"].deferred_bytes == 0
    assert sum(n.deferred_bytes for n in p.nodes) == 4 * 8 * 4 + 4 * 16 * 4
    options = SplitOptions(gpus=2, device=device, memory_limit=float("inf"), microbatches=2)
    plan = plan_split(traced, label="TwoHeads", options=options)
    weight = sum(n.backward_weight_s for n in p.nodes)
    assert sum(s.backward_weight_s for s in plan.stages) == pytest.approx(weight)
    for stage in plan.stages:
        assert stage.backward_input_s + stage.backward_weight_s == pytest.approx(stage.backward_s)
    raw = plan.to_dict()["stages"][0]
    assert raw["backward_input_s"] == pytest.approx(plan.stages[0].backward_input_s)
    assert type(plan).from_json(plan.to_json()).stages == plan.stages


class Halves(nn.Module):
    """A tuple read only by indexing (torch.split), and one returned whole (topk)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = torch.split(self.fc(x), 4, dim=1)
        return a.relu(), b.tanh(), torch.topk(x, 2)


def test_a_tuple_read_only_by_indexing_stays_with_its_indexing() -> None:
    """torch.distributed.pipelining passes tensors between stages, not tuples: the split
    shares a stage with its getitems, so the halves cross a cut, never the pair; topk's
    pair, which the model returns whole, is not held to anything."""
    traced = trace(Halves(), (torch.randn(4, 8),))
    device = get_device("h100")
    analyze(traced, device=device)
    lowered = lower(traced.gm, num_stages=2, device=device, memory_limit=float("inf"),
                    schedule=ScheduleKind.ONE_F_ONE_B, microbatches=2)
    names = [{lowered.problem.nodes[i].name for i in group}
             for group in lowered.problem.colocate]
    assert {"split", "getitem", "getitem_1"} in names
    assert not any("topk" in group for group in names)


def test_keep_levels_order_by_work_then_width_and_skip_what_the_model_writes() -> None:
    """Each level adds the next (work, width) of the outputs selective recompute may keep,
    the most work per element first, then the narrowest; the last keeps all (0, 0). The
    outputs the model writes into in place are in no level; where it writes into all,
    none is left. Beyond MAX_KEEP_LEVELS classes, the levels spread over them, from the
    leanest (the first class alone) to all."""
    kept = [Kept(64, 8, 1), Kept(64, 32, 1), Kept(16, 32, 1), Kept(64, 8, 5)]
    assert keep_levels(kept) == ((64, 8), (64, 32), (0, 0))
    assert keep_levels(kept, {(64, 32)}) == ((64, 8), (0, 0))
    assert keep_levels(kept, {(64, 8), (64, 32), (16, 32)}) == ()
    assert keep_levels([]) == ()
    many = [Kept(work, 1, 1) for work in range(1, 3 * MAX_KEEP_LEVELS + 1)]
    levels = keep_levels(many)
    assert len(levels) == MAX_KEEP_LEVELS and levels[-1] == (0, 0)
    assert levels[0] == (3 * MAX_KEEP_LEVELS, 1)  # the most work per element, alone
    works = [w for w, _ in levels[:-1]]
    assert works == sorted(set(works), reverse=True)
    gaps = [a - b for a, b in itertools.pairwise(works)]
    assert max(gaps) - min(gaps) <= 1  # evenly spread


def test_each_op_pays_what_sacs_host_time_its_device_time_does_not_hide() -> None:
    """Recomputed selectively, every op runs through torch's SAC on its first run and its
    run again, each time taking the host ``Device.sac_dispatch``: an op shorter than that
    keeps the device waiting the rest (twice), a longer one hides it."""
    wide = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU())
    traced = trace(wide, (torch.randn(1024, 4096),))
    device = get_device("h100")
    analyze(traced, device=device)
    lowered = lower(traced.gm, num_stages=1, device=device, memory_limit=float("inf"),
                    schedule=ScheduleKind.ONE_F_ONE_B, microbatches=1)
    by_name = {n.name: n for n in lowered.problem.nodes}
    matmul, relu = by_name["_0"], by_name["_1"]
    assert matmul.forward_s > device.sac_dispatch > relu.forward_s
    assert matmul.selective_host_s == 0.0
    assert relu.selective_host_s == pytest.approx(2 * (device.sac_dispatch - relu.forward_s))
    assert relu.selective(0)[1] == pytest.approx(relu.forward_s + relu.selective_host_s)
