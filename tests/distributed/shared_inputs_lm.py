"""A tiny causal LM whose forward takes two inputs without a batch dimension: an
additive (T, T) causal mask and HF-style ``position_ids`` of shape (1, T), shared by
every sample. A model file (``batch_dims()`` says which inputs are shared) for the
torchrun tests.

T equals the mini-batch's rows (M micro-batches of B samples), so the mask's dim 0
looks like a batch dimension: split along it, each micro-batch would get rows of the
mask, and ``position_ids`` (one row) could not be split at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, T, D, B, M = 50, 4, 16, 2, 2  # vocabulary, tokens, width, samples, micro-batches


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.mlp = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / D**0.5 + mask
        h = h + self.proj(torch.softmax(scores, dim=-1) @ v)
        return h + torch.tanh(self.mlp(h))


class SharedInputsLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D)
        self.positions = nn.Embedding(T, D)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(input_ids) + self.positions(position_ids)
        for block in self.blocks:
            h = block(h, mask)  # every stage reads the mask
        return self.head(h)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return SharedInputsLM()


def causal_mask() -> torch.Tensor:
    return torch.full((T, T), float("-inf")).triu(1)


def example_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    return ids, causal_mask(), torch.arange(T).unsqueeze(0)


def batch_dims() -> tuple[int | None, ...]:
    return (0, None, None)


def example_target() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (B, T), generator=g)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def mini_batch(rows: int, seed: int = 3) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``rows`` samples of distinct token ids and targets, the shared inputs once."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, T), generator=g)
    target = torch.randint(0, VOCAB, (rows, T), generator=g)
    return (ids, causal_mask(), torch.arange(T).unsqueeze(0)), target
