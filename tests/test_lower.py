"""lower(): which ops the model returns, and the loss's default memory."""

from __future__ import annotations

import torch
from torch import nn

from fxpipe.compiler import analyze
from fxpipe.cost_models import get_device
from fxpipe.frontend import trace
from fxpipe.lower import LOSS_FACTORS, lower
from fxpipe.partition import Schedule


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
                    schedule=Schedule.ONE_F_ONE_B, microbatches=2)
    p = lowered.problem
    returned = {n.name: n.output_bytes for n in p.nodes if n.returned}
    assert returned == {"head": 4 * 5 * 4, "relu": 4 * 16 * 4}
    assert not any(n.returned for n in p.nodes if n.name not in returned)
    total = sum(returned.values())
    assert (p.loss_saved_bytes, p.loss_grad_bytes) == (total * LOSS_FACTORS[0],
                                                       total * LOSS_FACTORS[1])
