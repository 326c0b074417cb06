"""The shims for torch 2.11's pipelining (fxpipe/runtime/older_torch.py), on this torch:
what torch 2.11 would do is called directly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from fxpipe.runtime.older_torch import skip_warmup_sends_to_self, step


@pytest.fixture
def one_rank():  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def two_stages_on_one_rank() -> list[PipelineStage]:
    x = torch.empty(2, 4)
    return [PipelineStage(nn.Linear(4, 4), k, 2, torch.device("cpu"), input_args=(x,),
                          output_args=(x,)) for k in range(2)]


@pytest.mark.usefixtures("one_rank")
def test_the_warmup_of_two_stages_on_one_rank_sends_to_no_rank_itself() -> None:
    """torch 2.11's schedules run each stage's warm-up ops: between stage 0 and stage 1,
    both on rank 0, a send to itself that gloo refuses."""
    stages = two_stages_on_one_rank()
    assert {op.peer for s in stages for op in s._get_init_p2p_neighbors_ops()} == {0}
    assert skip_warmup_sends_to_self(stages) is stages
    assert [op for s in stages for op in s._get_init_p2p_neighbors_ops()] == []


@pytest.mark.usefixtures("one_rank")
def test_one_stage_keeps_its_warmup() -> None:
    (stage,) = skip_warmup_sends_to_self(two_stages_on_one_rank()[1:])
    assert [op.peer for op in stage._get_init_p2p_neighbors_ops()] == [0, 0]


class Refusing:
    """A schedule that fails as torch 2.11's does on a received tensor of booleans."""

    def __init__(self, message: str) -> None:
        self.message = message

    def step(self, *feed: object, **kwargs: object) -> None:
        raise RuntimeError(self.message)


def stage(index: int, **received: torch.dtype) -> SimpleNamespace:
    return SimpleNamespace(stage_index=index, is_first=index == 0,
                           submod=SimpleNamespace(receives=tuple(received)),
                           inputs_meta=[torch.empty(1, dtype=d) for d in received.values()])


def test_a_received_mask_fails_in_one_line_naming_it() -> None:
    stages = [stage(0, input_ids=torch.int64),
              stage(1, hidden=torch.float32, mask=torch.bool, positions=torch.int64)]
    refusing = Refusing("only Tensors of floating point dtype can require gradients")
    with pytest.raises(RuntimeError) as info:
        step(refusing, stages)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("stage 1 receives 'mask' (torch.bool), 'positions' (torch.int64)")
    assert "torch 2.13 or later" in message


def test_other_errors_pass_unchanged() -> None:
    with pytest.raises(RuntimeError, match=r"^out of memory$"):
        step(Refusing("out of memory"), [stage(1, hidden=torch.float32)])
