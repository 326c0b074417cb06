"""Recompute chosen per stage against recompute everywhere, on memory-bound LLMs.

For each case (a transformers Llama shape on the meta device, one micro-batch of
1 x SEQ tokens, float32, Adam, 1F1B with M = 4 x GPUs, the h100 table entry's 80 GiB)
the model is traced and costed once, then planned four times, as

    fxpipe split MODEL --gpus N --device h100 --recompute {none,all,selective,auto}

would (``plan_split``): the predicted iteration time of each, whether it fits, how
``auto`` recomputes each stage (none, selective or full), and each baseline's iteration
time under ``all`` and under ``auto`` (a baseline's cut with each stage's fastest choice
that fits). The goal: ``auto`` >= 1.15x faster than ``all`` wherever ``none`` does not
fit. Prints a markdown table and the machine's load average.

Cases: Llama-3-8B (32 layers, width 4096) on 8 GPUs at 4096 tokens; a Llama-3-70B
shape (80 layers, width 8192, 64 heads, 8 KV heads, FFN 28672) on 16 and 32 GPUs at
4096 and 8192 tokens.

    python bench/recompute_choice.py [--only 8b 70b] [--cases 70b:4096:32 ...]
                                     [--time-limit 30] [--precision bf16-mixed]

``--precision`` plans every case at that precision (``fxpipe split --precision``), as
LLMs train: under ``bf16-mixed`` the activations are bfloat16 while the weights,
gradients and Adam state stay float32.

Where ``all`` does not fit, ``auto`` cannot either (recomputing everywhere is the least
memory any choice has), so it is not planned; at more tokens the same GPUs do not fit
either (every kind of memory grows with the tokens or stays).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from fxpipe import cli
from fxpipe.compiler import SplitOptions, plan_split
from fxpipe.cost_models import get_device
from fxpipe.partition import InfeasibleMemoryError, NoSolutionError, Recompute
from fxpipe.plan import Plan, StageRecompute
from fxpipe.precision import Precision, parse_precision

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ("uniform-layers", "parameters", "greedy-time")

LLAMA = '''\
"""transformers LlamaForCausalLM, {name} shape, on the meta device; 1 x {seq} tokens."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_model():
    cfg = LlamaConfig(hidden_size={width}, intermediate_size={ffn}, num_hidden_layers={layers},
                      num_attention_heads={heads}, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings={seq}, rope_theta=500000.0, use_cache=False,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return model.train()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return {{"input_ids": torch.randint(0, 128256, (1, {seq}), generator=g)}}
'''

SHAPES = {
    "8b": dict(name="Llama-3-8B", width=4096, ffn=14336, layers=32, heads=32),
    "70b": dict(name="Llama-3-70B", width=8192, ffn=28672, layers=80, heads=64),
}
CASES = [("8b", 4096, 8), ("70b", 4096, 16), ("70b", 4096, 32), ("70b", 8192, 16),
         ("70b", 8192, 32)]


def precision_flag(parser: argparse.ArgumentParser) -> None:
    """``--precision``, as ``fxpipe split`` takes it (both recompute benchmarks plan by it)."""
    parser.add_argument("--precision", default=None,
                        help="32-true, bf16-mixed, bf16-true or 16-mixed (default: the "
                             "model's, float32)")


def traced_llama(folder: str, shape: str, seq: int, precision: str | None) -> object:
    """The Llama shape at ``seq`` tokens, traced and costed as ``fxpipe split`` would for
    the h100 (its model file written into ``folder``)."""
    path = Path(folder) / f"llama_{shape}_{seq}.py"
    path.write_text(textwrap.dedent(LLAMA.format(seq=seq, **SHAPES[shape])))
    return cli.analyze_model(str(path), device="h100", precision=precision, quiet=True)[1]


def plan(traced: object, *, gpus: int, recompute: Recompute, time_limit: float,
         precision: Precision | None) -> tuple[Plan | None, float]:
    """The plan (None if nothing fits) and the wall time of planning."""
    device = get_device("h100")
    options = SplitOptions(gpus=gpus, device=device, memory_limit=float(device.memory_bytes),
                           microbatches=4 * gpus, recompute=recompute,
                           time_limit_s=time_limit, precision=precision)
    start = time.perf_counter()
    try:
        result = plan_split(traced, label="llama", options=options)  # type: ignore[arg-type]
    except (InfeasibleMemoryError, NoSolutionError):
        result = None
    return result, time.perf_counter() - start


def ms(plan: Plan | None) -> str:
    return "does not fit" if plan is None else f"{plan.estimate.iteration_s * 1e3:.0f} ms"


def baseline_ms(plan: Plan | None, name: str) -> str:
    if plan is None or name not in plan.baselines:
        return "-"
    est = plan.baselines[name]
    return f"{est.iteration_s * 1e3:.0f} ms" if est.fits else "does not fit"


def recomputed(plan: Plan) -> str:
    """How a plan's stages recompute, as runs of stage indices: "full 0-12, selective
    13-20, selective:57344:8192 21" (the runtime's modes; "none" where none does)."""
    runs: list[list[object]] = []  # [mode, first, last]
    for stage in plan.stages:
        mode = stage.recompute_mode
        if runs and runs[-1][0] == mode and runs[-1][2] == stage.index - 1:
            runs[-1][2] = stage.index
        else:
            runs.append([mode, stage.index, stage.index])
    said = [f"{mode} {a}" + (f"-{b}" if b != a else "")
            for mode, a, b in runs if mode != StageRecompute.NONE.value]
    return ", ".join(said) or "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--cases", nargs="*", default=None,
                        help="SHAPE:TOKENS:GPUS, e.g. 70b:4096:32 (default: all listed)")
    parser.add_argument("--time-limit", type=float, default=30.0)
    precision_flag(parser)
    args = parser.parse_args()
    precision = None if args.precision is None else parse_precision(args.precision)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, load average before {os.getloadavg()}, "
          f"time limit {args.time_limit:g} s per plan, "
          f"precision {args.precision or '32-true (the model)'}\n")
    header = ["model", "tokens", "GPUs", "none", "all", "selective", "auto", "all / auto",
              "auto recomputes stages", "auto status"] + [
        f"{b} (all / auto)" for b in BASELINES]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    cases = CASES if args.cases is None else [
        (shape, int(seq), int(gpus)) for shape, seq, gpus in (c.split(":") for c in args.cases)]
    with tempfile.TemporaryDirectory() as folder:
        traced_cache: dict[tuple[str, int], object] = {}
        for shape, seq, gpus in cases:
            if shape not in args.only:
                continue
            key = (shape, seq)
            if key not in traced_cache:
                start = time.perf_counter()
                traced_cache[key] = traced_llama(folder, shape, seq, args.precision)
                print(f"{SHAPES[shape]['name']} {seq} tokens: traced and costed in "
                      f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
            traced = traced_cache[key]
            plans: dict[Recompute, Plan | None] = {}
            for policy in (Recompute.NONE, Recompute.FULL, Recompute.SELECTIVE, Recompute.AUTO):
                if policy is Recompute.AUTO and plans[Recompute.FULL] is None:
                    plans[policy] = None  # the least memory does not fit: nothing does
                    continue
                plans[policy], wall = plan(traced, gpus=gpus, recompute=policy,
                                           time_limit=args.time_limit,
                                           precision=precision)
                print(f"  {gpus} GPUs, --recompute {policy.value}: {ms(plans[policy])} "
                      f"({wall:.1f} s)", file=sys.stderr)
            auto, everywhere = plans[Recompute.AUTO], plans[Recompute.FULL]
            speedup = ("-" if auto is None or everywhere is None else
                       f"{everywhere.estimate.iteration_s / auto.estimate.iteration_s:.2f}x")
            chosen = "-" if auto is None else recomputed(auto)
            status = "-" if auto is None else auto.solver.status
            row = [f"{SHAPES[shape]['name']}", str(seq), str(gpus),
                   ms(plans[Recompute.NONE]), ms(everywhere), ms(plans[Recompute.SELECTIVE]),
                   ms(auto), speedup, chosen,
                   status] + [f"{baseline_ms(everywhere, b)} / {baseline_ms(auto, b)}"
                              for b in BASELINES]
            print("| " + " | ".join(row) + " |", flush=True)
    print(f"\nload average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
