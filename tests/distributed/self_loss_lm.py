"""A tiny causal LM that computes its own loss, as nanoGPT's does: ``model(X, Y)``
returns ``(logits, loss)``, the file's ``loss_fn`` picks the loss, and there is no
``example_target()`` (the targets are an input). A model file for the torchrun tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, T, D, B = 50, 8, 16, 2  # vocabulary, tokens, width, samples per micro-batch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(torch.tanh(self.fc(h)))


class SelfLossLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tokens(idx)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return logits, loss


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return SelfLossLM()


def mini_batch(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, Y): ``rows`` samples of token ids and their next tokens."""
    ids = torch.randint(0, VOCAB, (rows, T + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def example_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return mini_batch(B)


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], _target: object) -> torch.Tensor:
    return output[1]
