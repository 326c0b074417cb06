"""fxpipe.batching by argument position: one tensor passed as two arguments (a language
model's tokens as their own targets, ``model(idx, idx)``) is two inputs, each decided and
named on its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpipe.batching import BatchDimsError, decide_batching
from fxpipe.frontend import trace

VOCAB, T = 11, 16


class TokensAndTargets(nn.Module):
    """nanoGPT's signature: logits, and the loss where targets are given."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.embed(idx))
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


class Broadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + y


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.a(x) + table.sum(0)


@pytest.mark.parametrize("rows", [1, 2])
def test_one_tensor_as_tokens_and_targets_is_batched(rows: int) -> None:
    idx = torch.randint(0, VOCAB, (rows, T))
    decision = decide_batching(TokensAndTargets(), (idx, idx), {})
    assert decision.batched == {id(idx)}, decision
    traced = trace(TokensAndTargets(), (idx, idx))
    assert traced.batched == (True, True) and traced.shared_inputs == ()


def test_one_tensor_passed_twice_is_named_by_each_position() -> None:
    x = torch.randn(1, 8)
    with pytest.raises(BatchDimsError, match=r"argument 0 \(1, 8\), argument 1 \(1, 8\) have"):
        decide_batching(Broadcast(), (x, x), {})
    with pytest.raises(BatchDimsError, match=r"argument 0 \(1, 8\), 'y' \(1, 8\) have"):
        decide_batching(Broadcast(), (x,), {"y": x})


def test_one_tensor_batched_in_one_place_and_shared_in_another_is_refused() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(BatchDimsError, match=r"argument 0 and argument 1 are one tensor, but "
                       r"only argument 0 has a batch dimension: pass argument 1 a copy"):
        decide_batching(Table(), (x, x), {})
    with pytest.raises(BatchDimsError, match="are one tensor"):
        decide_batching(Table(), (x, x), {}, declared=(0, None))
    decision = decide_batching(Table(), (x, x.clone()), {})  # a copy of its own: decided
    assert decision.batched == {id(x)}
