"""GPipe's Transformer-L (Huang et al., NeurIPS 2019, Table 1): L layers of model width
2048, feed-forward 8192, 32 heads, a 32k vocabulary with separate input embedding and
softmax; trained with RMSProp (12 bytes per parameter: ``--optimizer sgd-momentum``).
GPipe's figures: 3 layers on one 16 GB TPUv3 without GPipe, 13 with re-materialization,
103 on 8 partitions, 415 on 32 and 1,663 (83.9B parameters) on 128.

Built on the meta device (nothing allocated), as a plain ``nn.ModuleList`` of layers that
``symbolic_trace`` captures; one micro-batch of 1 x 1024 tokens::

    fxpipe split bench/gpipe_transformer.py:layers_103 --gpus 8 --memory 16GiB \\
        --optimizer sgd-momentum --recompute all --device v100 --schedule gpipe \\
        --microbatches 32

``layers(L)`` makes the factory for any L (``layers_13``, ``layers_103``, ``layers_415``,
``layers_1663`` are GPipe's columns).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, FFN, HEADS, VOCAB, TOKENS = 2048, 8192, 32, 32000, 1024


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, FFN)
        self.down = nn.Linear(FFN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.relu(self.up(self.norm2(x))))


class TransformerL(nn.Module):
    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(num_layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.softmax = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.softmax(self.norm(x))


def layers(num_layers: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.device("meta"):
            return TransformerL(num_layers)
    build.__name__ = f"layers_{num_layers}"
    return build


layers_13, layers_103, layers_415, layers_1663 = (layers(n) for n in (13, 103, 415, 1663))
build_model = layers_103


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (1, TOKENS)),)


def example_target() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, TOKENS))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
