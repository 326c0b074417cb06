"""A readable Llama-shaped decoder: RMSNorm, rotary position embeddings
(real-valued cos/sin, no complex numbers), grouped-query attention, a SwiGLU
MLP and an untied LM head.

Factories (pick one with ``fxpipe split examples/llama.py:NAME``):

- ``build_model``     small: 4 layers, width 128, 4 heads / 2 KV heads, vocab 1000
- ``build_llama3_8b`` Llama-3-8B shape (32 x 4096, 32 heads, 8 KV heads, MLP 14336,
  vocab 128256), ~8.03B params, on the meta device (no weights allocated)

``example_inputs()`` works for every factory (ids in ``[0, 1000)``); the 8B
factory also carries its own ``example_inputs`` attribute, a (2, 512) micro-batch.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 1000
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 352
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    batch_size: int = 2  # one micro-batch, used by example_inputs
    seq_len: int = 64

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count from the shapes (untied embedding and LM head)."""
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        attn = d * d + 2 * d * kv + d * d  # wq, wk, wv, wo
        mlp = 3 * d * self.ffn_dim  # w1 (gate), w3 (up), w2 (down)
        per_layer = attn + mlp + 2 * d  # + two RMSNorm weights
        return 2 * self.vocab_size * d + self.n_layers * per_layer + d


SMALL = LlamaConfig()
LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    max_seq_len=8192,
    rope_theta=500000.0,
    batch_size=2,
    seq_len=512,
)
LLAMA3_70B = LlamaConfig(
    vocab_size=128256,
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    ffn_dim=28672,
    max_seq_len=8192,
    rope_theta=500000.0,
    batch_size=1,
    seq_len=512,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Rotary(nn.Module):
    """Rotary embeddings as (t, head_dim) cos/sin tables, applied with rotate_half."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.half = hd // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        t = torch.arange(cfg.max_seq_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_seq, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_seq, hd)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = q.size(2)
        # narrow, not [:t]: slicing a buffer by a traced size breaks symbolic_trace
        cos = self.cos.narrow(0, 0, t).to(q.dtype)
        sin = self.sin.narrow(0, 0, t).to(q.dtype)
        q = q * cos + rotate_half(q, self.half) * sin
        k = k * cos + rotate_half(k, self.half) * sin
        return q, k


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        assert cfg.n_heads % cfg.n_kv_heads == 0
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.rotary = Rotary(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, k)
        # grouped-query attention: each KV head serves n_rep query heads
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, t, hd)
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.wo(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)  # untied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))  # (b, t, vocab) logits


def _build(cfg: LlamaConfig, device: str | None = None) -> Llama:
    torch.manual_seed(0)
    if device is None:
        return Llama(cfg)
    with torch.device(device):
        return Llama(cfg)


def build_model() -> nn.Module:
    """Small Llama for tests: 4 layers, width 128, 4 heads / 2 KV heads, vocab 1000."""
    return _build(SMALL)


def build_llama3_8b() -> nn.Module:
    """Llama-3-8B shape, ~8.03B params, on the meta device."""
    return _build(LLAMA3_8B, "meta")


def build_llama3_70b() -> nn.Module:
    """Llama-3-70B shape (80 layers, width 8192, 64 heads / 8 KV heads), on the meta device."""
    return _build(LLAMA3_70B, "meta")


def example_inputs_llama3_70b() -> tuple[torch.Tensor]:
    """A (1, 512) micro-batch for ``build_llama3_70b``."""
    return (_token_ids(LLAMA3_70B, seed=1, shift=0),)


def _token_ids(cfg: LlamaConfig, seed: int, shift: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    high = min(cfg.vocab_size, SMALL.vocab_size)
    ids = torch.randint(0, high, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    return ids[:, shift : shift + cfg.seq_len]


def example_inputs() -> tuple[torch.Tensor]:
    """One micro-batch of token ids, shape (2, 64), values in [0, 1000)."""
    return (_token_ids(SMALL, seed=1, shift=0),)


def example_target() -> torch.Tensor:
    """Next-token ids for ``example_inputs()``."""
    return _token_ids(SMALL, seed=1, shift=1)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def example_inputs_llama3_8b() -> tuple[torch.Tensor]:
    """A (2, 512) micro-batch for ``build_llama3_8b``."""
    return (_token_ids(LLAMA3_8B, seed=1, shift=0),)


def example_target_llama3_8b() -> torch.Tensor:
    return _token_ids(LLAMA3_8B, seed=1, shift=1)


# A frontend may prefer a factory's own micro-batch when it has one.
build_llama3_8b.example_inputs = example_inputs_llama3_8b  # type: ignore[attr-defined]
build_llama3_8b.example_target = example_target_llama3_8b  # type: ignore[attr-defined]
build_llama3_70b.example_inputs = example_inputs_llama3_70b  # type: ignore[attr-defined]
