"""fxpipe.runtime.adapter: a stage as torch.distributed.pipelining wants it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpipe.runtime.adapter import StageAdapter, check_feed


class Ids(nn.Module):
    INPUTS = ("ids",)
    OUTPUTS = ("h",)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (ids.float(),)


def test_torchrun_takes_the_built_shape_and_refuses_another_in_one_line() -> None:
    adapter = StageAdapter(Ids(), ("ids",), ("h",), {}, lambda values: values["h"])
    adapter.input_shapes = ((2, 32),)  # built with micro-batches of 2 x 32 tokens
    built = adapter.receives, adapter.input_shapes
    check_feed(*built, [torch.zeros(8, 32)], 4)  # 4 micro-batches of that shape
    for other in ((6, 32), (8, 16), (7, 32)):
        with pytest.raises(ValueError, match=rf"'ids' has shape \({other[0]}, {other[1]}\), "
                                             r"but under torchrun the stages were built for 4 "
                                             r"micro-batches of shape \(2, 32\)"):
            check_feed(*built, [torch.zeros(other)], 4)


def test_a_shared_input_is_fed_whole_at_its_built_shape() -> None:
    """Under torchrun a (T, T) mask shared by every sample is one mask, not M of them."""
    built = ("ids", "mask"), ((2, 4), (4, 4))
    check_feed(*built, [torch.zeros(4, 4), torch.zeros(4, 4)], 2, {"mask"})
    with pytest.raises(ValueError, match=r"'mask' has shape \(8, 4\), but under torchrun the "
                                         r"stages were built with it of shape \(4, 4\), handed "
                                         r"whole to every micro-batch"):
        check_feed(*built, [torch.zeros(4, 4), torch.zeros(8, 4)], 2, {"mask"})
    with pytest.raises(ValueError, match=r"'mask' has shape \(4, 4\).*built for 2 micro-batches"):
        check_feed(*built, [torch.zeros(4, 4), torch.zeros(4, 4)], 2)  # not declared shared
