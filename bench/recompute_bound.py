"""How much any recompute choice could gain over recomputing everywhere: a fluid bound.

``bench/recompute_choice.py`` measures what ``--recompute auto`` (none, a keep level or
full, per stage) gains over ``--recompute all`` on memory-bound Llama shapes. This script
asks what other choices could gain, per block down to a fraction of a layer or per op,
under the same cost model, by relaxing the split: each stage j of K holds any real number n_j of the
model's identical layers (the first stage also the embedding, the last the final norm, LM
head and loss), each layer keeping k_j of its A activation bytes for the micro-batches in
flight and running e_j seconds of its forward again in the backward, by one of the
options of the choice. Per stage, with the cost formula's terms (fxpipe/partition/cost.py)
and each layer's sums over its nodes (P parameter bytes, F forward and B backward
seconds, h the bytes one layer hands the next):

    time    n_j (F + B + e_j)                                 (+ the end groups')
    memory  n_j (P s + f_j k_j + (A - k_j))                   (s the state factor,
            + h f_j received + h (f_j + 1) kept + workspace    f_j in flight: 1F1B)

(what a layer does not keep is alive for one micro-batch while its backward reruns it).
The least bottleneck T at which the stages hold every layer (sum_j n_j >= layers, each
n_j the most its memory and T allow) is found by bisection for each choice
(``Fluid.choices``): ``none``, ``all``, ``per stage`` (none or all), ``per block`` (any
fraction of the layer, at that fraction of F: finer than any real per-block recompute),
``op-level`` (the layer's cheapest ops per byte recomputed first), ``SAC`` (none, all, or
the matmuls' and attention's outputs kept and the rest recomputed) and ``SAC levels``
(the same at any of the model's keep levels, ``Problem.keep_levels``: what ``auto``
chooses from), and ``levels per layer`` (the same options, but each layer of a stage at
its own: Megatron's ``recompute_num_layers`` at the grain of the keep levels, the finest
choice a stage's runtime could be given without new kinds of recompute).
The relaxation is optimistic for every choice alike (whole layers and cuts at node
boundaries only add time); the ratio of two relaxed bottlenecks says how far apart the
choices can be, not a proof. Prints a markdown table and the load average.

    python bench/recompute_bound.py [--cases 70b:4096:32 70b:8192:32 8b:4096:8]
                                    [--precision bf16-mixed]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recompute_choice import SHAPES, precision_flag, traced_llama

from fxpipe.compiler import SplitOptions, _lowered
from fxpipe.cost_models import get_device
from fxpipe.partition import Node, Problem, Recompute
from fxpipe.partition.problem import stage_flights
from fxpipe.precision import parse_precision

LAYERS = "model.layers."
# The choices whose stages may give each layer its own option.
MIXED = {"levels per layer"}

# A layer's option: (activation bytes it keeps per micro-batch in flight, forward seconds
# its backward runs again); what it does not keep is alive for one micro-batch in the
# backward. ``choices`` lists the options of each way of recomputing.
Option = tuple[float, float]


@dataclass(frozen=True)
class Sums:
    """Sums over a group of nodes, for one micro-batch."""

    params: float = 0.0
    activations: float = 0.0
    time_s: float = 0.0  # forward + backward
    forward_s: float = 0.0


def sums(nodes: Sequence[Node]) -> Sums:
    return Sums(sum(n.param_bytes for n in nodes), sum(n.activation_bytes for n in nodes),
                sum(n.forward_s + n.backward_s for n in nodes), sum(n.forward_s for n in nodes))


class Fluid:
    """The relaxed problem of one traced Llama shape on ``problem.num_stages`` stages."""

    def __init__(self, problem: Problem) -> None:
        layers: dict[str, list[Node]] = {}
        first: list[Node] = []
        last: list[Node] = []
        for node in problem.nodes:
            if node.module.startswith(LAYERS):
                layers.setdefault(".".join(node.module.split(".")[:3]), []).append(node)
            else:
                (last if layers else first).append(node)
        self.nodes = next(iter(layers.values()))
        self.layers = len(layers)
        self.layer = sums(self.nodes)
        self.hidden = self.nodes[-1].output_bytes
        self.first, self.last = sums(first), sums(last)
        self.problem = problem
        self.flights = stage_flights(problem)

    def choices(self) -> dict[str, list[Option]]:
        """The options per layer of each way of recomputing: none, all, per stage (none or
        all), per block (any fraction of the layer's activations, at that fraction of its
        forward), op-level (the cheapest ops per byte of activation recomputed first,
        whatever the order), SAC (what the plan's selective recompute keeps when it keeps
        all the matmuls' and attention's outputs; the rest recomputed) and SAC levels (the
        same at each keep level: ``Node.selective``), per stage or (levels per layer, see
        ``MIXED``) per layer."""
        A, F = self.layer.activations, self.layer.forward_s
        by_cost = sorted(self.nodes, key=lambda n: n.forward_s / max(n.activation_bytes, 1))
        curve: list[Option] = [(A, 0.0)]
        for node in by_cost:
            curve.append((curve[-1][0] - node.activation_bytes, curve[-1][1] + node.forward_s))
        levels = [(sum(n.selective(level)[0] for n in self.nodes),
                   sum(n.selective(level)[1] for n in self.nodes))
                  for level in range(len(self.problem.keep_levels))]
        return {"none": [(A, 0.0)], "all": [(0.0, F)], "per stage": [(A, 0.0), (0.0, F)],
                "per block": [(A * i / 200, F * (1 - i / 200)) for i in range(201)],
                "op-level": curve, "SAC": [(A, 0.0), levels[-1], (0.0, F)],
                "SAC levels": [(A, 0.0), *levels, (0.0, F)],
                "levels per layer": [(A, 0.0), *levels, (0.0, F)]}

    def holds(self, j: int, bottleneck_s: float, options: Sequence[Option],
              mixed: bool = False) -> float:
        """The most layers stage j holds within ``bottleneck_s`` and its memory, each
        recomputing by one of ``options``: all by the same one, or (``mixed``) each layer
        by its own."""
        p, K, f = self.problem, self.problem.num_stages, self.flights[j]
        end = (self.first if j == 0 else Sums()), (self.last if j == K - 1 else Sums())
        fixed_s = sum(e.time_s for e in end)
        fixed = sum(e.params * p.state_factor + e.activations * f for e in end)
        fixed += p.workspace_bytes + p.loss_grad_bytes * (j == K - 1)
        fixed += self.hidden * (f * (j > 0) + (f + 1) * (j < K - 1))
        time_left, memory_left = bottleneck_s - fixed_s, p.memory_limit - fixed
        if time_left <= 0 or memory_left <= 0:
            return 0.0
        # Each option's (seconds, bytes) per layer; the stage holds x_i layers by option i
        # within both budgets. One option alone, or (``mixed``) two side by side, where the
        # linear program's optimum lies: both budgets spent exactly.
        costs = [(self.layer.time_s + again_s,
                  self.layer.params * p.state_factor + kept * f + (self.layer.activations - kept))
                 for kept, again_s in options]
        most = max(min(time_left / t, memory_left / m) for t, m in costs)
        if mixed:
            for (t1, m1), (t2, m2) in itertools.combinations(costs, 2):
                det = t1 * m2 - t2 * m1
                if det == 0:
                    continue
                x1 = (time_left * m2 - t2 * memory_left) / det
                x2 = (t1 * memory_left - time_left * m1) / det
                if x1 >= 0 and x2 >= 0:
                    most = max(most, x1 + x2)
        return most

    def bottleneck(self, options: Sequence[Option], mixed: bool = False) -> float | None:
        """The least relaxed bottleneck (seconds per micro-batch); None if none fits."""
        K = self.problem.num_stages

        def fits(t: float) -> bool:
            return sum(self.holds(j, t, options, mixed) for j in range(K)) >= self.layers
        hi = (self.layers * (self.layer.time_s + self.layer.forward_s)
              + self.first.time_s + self.last.time_s)
        if not fits(hi):
            return None
        lo = 0.0
        while hi - lo > 1e-6 * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return hi


def ratio(found: dict[str, float | None], name: str) -> str:
    """How many times faster ``name``'s relaxed bottleneck is than recomputing everywhere."""
    a, b = found["all"], found[name]
    return "-" if a is None or b is None else f"{a / b:.3f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=["70b:4096:32", "70b:8192:32",
                                                         "8b:4096:8"],
                        help="SHAPE:TOKENS:GPUS")
    precision_flag(parser)
    args = parser.parse_args()
    precision = None if args.precision is None else parse_precision(args.precision)
    print(f"load average before {os.getloadavg()}, "
          f"precision {args.precision or '32-true (the model)'}\n")
    names = ("none", "all", "per stage", "per block", "op-level", "SAC", "SAC levels",
             "levels per layer")
    header = ["model", "tokens", "GPUs", *(f"{c} (ms)" for c in names),
              *(f"all / {c}" for c in names[2:])]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    device = get_device("h100")
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases:
            shape, seq, gpus = case.split(":")
            start = time.perf_counter()
            traced = traced_llama(folder, shape, int(seq), args.precision)
            options = SplitOptions(gpus=int(gpus), device=device,
                                   memory_limit=float(device.memory_bytes),
                                   microbatches=4 * int(gpus), recompute=Recompute.AUTO,
                                   precision=precision)
            fluid = Fluid(_lowered(traced, options).problem)
            found = {name: fluid.bottleneck(options, mixed=name in MIXED)
                     for name, options in fluid.choices().items()}
            print(f"{case}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
            cells = ["does not fit" if t is None else f"{t * 1e3:.1f}" for t in found.values()]
            print("| " + " | ".join([str(SHAPES[shape]["name"]), seq, gpus, *cells,
                                     *(ratio(found, c) for c in names[2:])]) + " |",
                  flush=True)
    print(f"\nload average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
