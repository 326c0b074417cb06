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

``layers(L)`` makes the factory for any L, and ``layers_L`` names it for the command line
(``layers_13``, ``layers_103``, ``layers_415``, ``layers_1663`` are GPipe's columns).

Run as a script, it finds the largest L that fxpipe says fits in 16 GiB per accelerator
under GPipe's own schedule, for one of GPipe's columns (by bisection over L, each L
planned in a child process; GPipe's figure is the first guess)::

    python bench/gpipe_transformer.py --largest --gpus 8 --microbatches 32 --recompute all
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
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


def __getattr__(name: str) -> Callable[[], nn.Module]:
    """``layers_L`` for any other L (``layers_100``, ``layers_1600``: the growth table)."""
    prefix, _, count = name.partition("_")
    if prefix == "layers" and count.isdigit():
        return layers(int(count))
    raise AttributeError(name)


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (1, TOKENS)),)


def example_target() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, TOKENS))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


# GPipe's Table 1: accelerators -> the largest L (re-materialization on; 1 without it: 3)
GPIPE = {1: 13, 8: 103, 32: 415, 128: 1663}
GPIPE_NAIVE = 3


def _fits(num_layers: int, gpus: int, microbatches: int, recompute: str) -> float | None:
    """The largest stage's bytes of L layers planned onto ``gpus`` under GPipe's schedule
    in 16 GiB (v100's row, sgd-momentum: 12 bytes a parameter); None when nothing fits."""
    import fxpipe
    from fxpipe.cluster import NoLayoutFits
    from fxpipe.partition import InfeasibleMemoryError, NoSolutionError

    try:
        plan = fxpipe.split(layers(num_layers)(), example_inputs(), gpus=gpus, pp=gpus,
                            memory="16GiB", device="v100", schedule="gpipe",
                            microbatches=microbatches, optimizer="sgd-momentum",
                            recompute=recompute, loss_fn=loss_fn,
                            example_target=example_target(), work_limit=2.0)
    except (InfeasibleMemoryError, NoLayoutFits, NoSolutionError):
        return None
    return float(max(stage.memory.total for stage in plan.stages))


def _probe(num_layers: int, gpus: int, microbatches: int, recompute: str) -> float | None:
    """``_fits`` in a child process (each L's model and graph gone with it)."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(_fits, (num_layers, gpus, microbatches, recompute))


def largest(gpus: int, microbatches: int, recompute: str, guess: int, within: float = 0.0,
            between: tuple[int, int] | None = None) -> tuple[int, int]:
    """(lo, hi): lo layers fit and hi do not (0 if not even one layer does): up or down
    from ``guess`` by doubling steps until L fits and L + step does not, then bisection
    between, until hi - lo is 1 or at most ``within`` of lo (a probe of 1,663 layers is a
    minute on 2 cores); ``between`` = (lo, hi) known from an earlier search: bisection
    alone."""
    import fxpipe.api
    import fxpipe.compiler  # noqa: F401  (imported once, before the children fork)

    def fits(num_layers: int) -> bool:
        start = time.perf_counter()
        found = _probe(num_layers, gpus, microbatches, recompute)
        said = "does not fit" if found is None else f"fits, {found / 2**30:.2f} GiB"
        print(f"  L = {num_layers}: {said} ({time.perf_counter() - start:.1f} s)", flush=True)
        return found is not None

    lo, hi, step = 0, None, max(1, guess // 16)
    at = guess
    if between is not None:
        lo, hi = between
    elif fits(at):
        lo = at
        while hi is None:
            if fits(lo + step):
                lo, step = lo + step, 2 * step
            else:
                hi = lo + step
    else:
        hi = at
        while hi - step >= 1 and not fits(hi - step):
            hi, step = hi - step, 2 * step
        lo = max(hi - step, 0)
    while hi - lo > max(1.0, within * lo):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--largest", action="store_true", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--recompute", default="all", choices=("all", "none"))
    parser.add_argument("--within", type=float, default=0.0,
                        help="stop when the bracket is this share of L wide (default: exact)")
    parser.add_argument("--guess", type=int, help="the first L tried (default: GPipe's)")
    parser.add_argument("--between", type=int, nargs=2, metavar=("LO", "HI"),
                        help="bisect between LO layers, known to fit, and HI, known not to")
    args = parser.parse_args()
    recompute = "full" if args.recompute == "all" else "none"
    guess = GPIPE_NAIVE if args.recompute == "none" else GPIPE[args.gpus]
    print(f"GPipe's column: {args.gpus} accelerators, recompute {args.recompute}: "
          f"{guess} layers; fxpipe (gpipe schedule, M = {args.microbatches}, 1 x {TOKENS} "
          "tokens a micro-batch):", flush=True)
    start = time.perf_counter()
    lo, hi = largest(args.gpus, args.microbatches, recompute, args.guess or guess, args.within,
                     tuple(args.between) if args.between else None)
    said = f"{lo}" if hi == lo + 1 else f"{lo} to {hi - 1}"
    print(f"largest L: {said} (GPipe: {guess}); {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
