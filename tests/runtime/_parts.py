"""Hand-cut stages for the runtime tests: a ``Part`` binds some of a model's own
modules and Parameters under their names in the model and runs one of the
model's methods with itself as ``self``, so the stages compute exactly what the
unsplit model computes.

# K: stages, T: sequence length, D: width.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from codegen._models import import_package, write_package
from torch import nn

from fxpipe.frontend import trace
from fxpipe.plan import Estimate, Plan, SolverReport, StagePlan

T, D, HEADS, VOCAB = 5, 8, 2, 11


class Part(nn.Module):
    """A pipeline stage: ``fn(self, *inputs)`` over the model's members in ``members``,
    reading ``inputs`` by name and returning ``outputs`` (a tuple, in order)."""

    def __init__(self, inputs: tuple[str, ...], outputs: tuple[str, ...],
                 fn: Callable[..., Any], **members: Any) -> None:
        super().__init__()
        self.INPUTS, self.OUTPUTS = inputs, outputs
        self.fn = fn
        for name, member in members.items():
            setattr(self, name, member)

    def forward(self, **inputs: Any) -> tuple[Any, ...]:
        out = self.fn(self, *(inputs[name] for name in self.INPUTS))
        return out if isinstance(out, tuple) else (out,)


def flatten_x(x: torch.Tensor) -> dict[str, Any]:
    return {"x": x}


def output_of(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda values: values[name]


# ---------------------------------------------------------------- an MLP, one block per stage


class Chain(nn.Module):
    """K blocks of Linear, LayerNorm, tanh and a linear head; stage k runs block k."""

    def __init__(self, num_stages: int, width: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh())
            for _ in range(num_stages)
        )
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def chain_stages(model: Chain) -> list[nn.Module]:
    k_last = len(model.blocks) - 1
    stages: list[nn.Module] = []
    for k, block in enumerate(model.blocks):
        name_in = "x" if k == 0 else f"h{k - 1}"
        if k < k_last:
            stages.append(Part((name_in,), (f"h{k}",), lambda self, h: self.block(h), block=block))
        else:
            stages.append(Part((name_in,), ("y",), lambda self, h: self.head(self.block(h)),
                               block=block, head=model.head))
    return stages


# ------------------------------------- a transformer block: a causal mask and a skip cross stages


class TinyTransformer(nn.Module):
    """Token and position embeddings, causal self-attention, an MLP, pre-LayerNorm.

    stage 0: ids -> tok (B, T, D), pos (T, D: not batched, needs grad), mask (1, 1, T, T)
    stage 1: tok, pos, mask -> h (B, T, D)
    stage 2: h, tok (a skip from stage 0) -> logits (B, T, VOCAB)
    """

    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(T, D) / 4)
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 2 * D)
        self.fc_out = nn.Linear(2 * D, D)
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = ids.size(1)
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril().view(1, 1, t, t)
        return self.emb(ids), self.pos[:t] * 1.0, mask

    def attend(self, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = tok + pos
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return h + self.proj(att.transpose(1, 2).reshape(b, t, d))

    def mlp(self, h: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        h = h + self.fc_out(F.gelu(self.fc(self.ln2(h)))) + 0.5 * tok
        return self.head(self.ln_f(h))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tok, pos, mask = self.embed(ids)
        return self.mlp(self.attend(tok, pos, mask), tok)


def transformer_stages(model: TinyTransformer) -> list[nn.Module]:
    m = model
    return [
        Part(("ids",), ("tok", "pos", "mask"), TinyTransformer.embed, emb=m.emb, pos=m.pos),
        Part(("tok", "pos", "mask"), ("h",), TinyTransformer.attend,
             heads=m.heads, ln1=m.ln1, qkv=m.qkv, proj=m.proj),
        Part(("h", "tok"), ("logits",), TinyTransformer.mlp,
             ln2=m.ln2, fc=m.fc, fc_out=m.fc_out, ln_f=m.ln_f, head=m.head),
    ]


def flatten_ids(ids: torch.Tensor) -> dict[str, Any]:
    return {"ids": ids}


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


# ------------------------------------------------- the same through a generated package




def generated_package(directory: Path, model: nn.Module, example: torch.Tensor,
                      replicas: tuple[int, ...], schedule: str,
                      microbatches: int) -> types.ModuleType:
    """``model`` traced on ``example``, its ops cut into len(replicas) equal runs by a
    hand-written plan with these replicas and schedule, written to ``directory`` and
    imported."""
    traced = trace(model, (example,))
    ops = [n.name for n in traced.gm.graph.nodes if n.op == "call_module"]
    num_stages = len(replicas)
    stages = tuple(
        StagePlan(index=k, replicas=r,
                  nodes=tuple(ops[len(ops) * k // num_stages: len(ops) * (k + 1) // num_stages]))
        for k, r in enumerate(replicas)
    )
    plan = Plan(num_stages=num_stages, schedule=schedule, microbatches=microbatches,
                stages=stages, solver=SolverReport("hand-written", "HEURISTIC", 0.0, 0.0),
                estimate=Estimate(0.0, 0.0, 0.0, 0, True))
    write_package(directory, traced, plan)
    return import_package(directory)
