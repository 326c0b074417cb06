"""A readable GPT: token + position embeddings, pre-LN transformer blocks with
causal self-attention (explicit matmul / mask / softmax), a 4x GELU MLP, a
final LayerNorm and an LM head whose weight IS the token-embedding weight.

Factories (pick one with ``fxpipe split examples/gpt.py:NAME``):

- ``build_model``      small: 4 layers, width 128, vocab 1000, ctx 64 (CPU tests)
- ``build_gpt2_small`` GPT-2 small shape, ~124M params, on the meta device
- ``build_gpt_1p5b``   GPT-2 XL shape, ~1.56B params, on the meta device

The meta-device factories allocate no weights: they exist to be traced and
planned. ``example_inputs()`` is the same for every factory (token ids in
``[0, 1000)`` fit every vocabulary); the frontend moves them to the model's
device. Each large factory also carries an ``example_inputs`` attribute with a
micro-batch at a realistic sequence length.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 1000
    block_size: int = 64  # maximum context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    batch_size: int = 2  # one micro-batch, used by example_inputs
    seq_len: int = 64

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self) -> int:
        """Parameter count from the shapes (the LM head is tied, so counted once)."""
        d, v = self.n_embd, self.vocab_size
        layer_norms = 2 * 2 * d  # ln_1, ln_2 (weight + bias)
        qkv = d * 3 * d + 3 * d
        attn_proj = d * d + d
        mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)  # up + down
        per_block = layer_norms + qkv + attn_proj + mlp
        return v * d + self.block_size * d + self.n_layer * per_block + 2 * d


SMALL = GPTConfig()
GPT2_SMALL = GPTConfig(
    vocab_size=50257,
    block_size=1024,
    n_layer=12,
    n_head=12,
    n_embd=768,
    batch_size=2,
    seq_len=1024,
)
GPT_1P5B = GPTConfig(
    vocab_size=50257,
    block_size=1024,
    n_layer=48,
    n_head=25,
    n_embd=1600,
    batch_size=1,
    seq_len=1024,
)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.n_embd = cfg.n_embd
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (b, h, t, hd)
        k = k.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        # narrow, not [:t, :t]: slicing a buffer by a traced size breaks symbolic_trace
        mask = self.causal_mask.narrow(0, 0, t).narrow(1, 0, t)
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (b, h, t, hd)
        y = y.transpose(1, 2).reshape(b, t, self.n_embd)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one Parameter, two users
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)  # (b, t, vocab) logits


def _build(cfg: GPTConfig, device: str | None = None) -> GPT:
    torch.manual_seed(0)
    if device is None:
        return GPT(cfg)
    with torch.device(device):
        return GPT(cfg)


def build_model() -> nn.Module:
    """Small GPT for tests: 4 layers, width 128, vocab 1000, ctx 64."""
    return _build(SMALL)


def build_gpt2_small() -> nn.Module:
    """GPT-2 small shape (12 x 768, 12 heads, vocab 50257, ctx 1024), on meta."""
    return _build(GPT2_SMALL, "meta")


def build_gpt_1p5b() -> nn.Module:
    """GPT-2 XL shape (48 x 1600, 25 heads, vocab 50257, ctx 1024), ~1.56B params, on meta."""
    return _build(GPT_1P5B, "meta")


def _token_ids(cfg: GPTConfig, seed: int, shift: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    high = min(cfg.vocab_size, SMALL.vocab_size)
    ids = torch.randint(0, high, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    return ids[:, shift : shift + cfg.seq_len]


def example_inputs() -> tuple[torch.Tensor]:
    """One micro-batch of token ids, shape (2, 64), values in [0, 1000)."""
    return (_token_ids(SMALL, seed=1, shift=0),)


def example_target() -> torch.Tensor:
    """Next-token ids for ``example_inputs()``: the same sequence shifted by one."""
    return _token_ids(SMALL, seed=1, shift=1)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def example_inputs_gpt2_small() -> tuple[torch.Tensor]:
    """A full-context micro-batch for ``build_gpt2_small``: (2, 1024)."""
    return (_token_ids(GPT2_SMALL, seed=1, shift=0),)


def example_target_gpt2_small() -> torch.Tensor:
    return _token_ids(GPT2_SMALL, seed=1, shift=1)


def example_inputs_gpt_1p5b() -> tuple[torch.Tensor]:
    """A full-context micro-batch for ``build_gpt_1p5b``: (1, 1024)."""
    return (_token_ids(GPT_1P5B, seed=1, shift=0),)


def example_target_gpt_1p5b() -> torch.Tensor:
    return _token_ids(GPT_1P5B, seed=1, shift=1)


# A frontend may prefer a factory's own micro-batch when it has one.
build_gpt2_small.example_inputs = example_inputs_gpt2_small  # type: ignore[attr-defined]
build_gpt2_small.example_target = example_target_gpt2_small  # type: ignore[attr-defined]
build_gpt_1p5b.example_inputs = example_inputs_gpt_1p5b  # type: ignore[attr-defined]
build_gpt_1p5b.example_target = example_target_gpt_1p5b  # type: ignore[attr-defined]
