"""How close the block bound (``fxpipe.partition.bound``) comes to the best split on the
Hugging Face shapes, one GPU per stage.

For each case the model is traced and costed as ``fxpipe split`` does (default flags:
1F1B, M = 4 x GPUs, the h100 table entry, recompute chosen per stage) and lowered; the
table gives the interval DP's split over the exact groups, the block bound and its wall
seconds, and, with ``--solve``, what ``partition()`` finds and proves. The bound is
below the optimum by what its relaxation drops; the smaller that distance, the sooner a
split is proved (a model too big for CP-SAT is settled by the bound alone when the DP's
split is within 1 % of it).

    PYTHONPATH=$PWD python bench/block_bound.py [--only 70b] [--solve]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT

from fxpipe.compiler import SplitOptions, _lowered, analyze_file
from fxpipe.cost_models import get_device
from fxpipe.partition import evaluate, exact_groups, interval_dp, partition
from fxpipe.partition.bound import block_bound

# label -> (model spec, GPUs)
CASES: dict[str, tuple[str, int]] = {
    "HF GPT-2 XL onto 8": ("bench/hf_shapes.py:build_gpt2_xl", 8),
    "HF Llama-3-8B onto 8": ("bench/hf_shapes.py:build_llama3_8b", 8),
    "HF Llama-3-70B onto 32": ("bench/hf_shapes.py:build_llama3_70b", 32),
    "HF GPT-OSS-20B onto 8": ("bench/hf_shapes.py:build_gpt_oss_20b", 8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="cases whose label contains this")
    parser.add_argument("--solve", action="store_true", help="also run partition()")
    args = parser.parse_args()
    device = get_device("h100")
    print(f"load average before {os.getloadavg()}\n")
    print("| case | exact groups | DP split | block bound | bound below DP | bound time "
          "| partition(): status, bottleneck | bound below it |")
    print("|---|---:|---:|---:|---:|---:|---|---:|", flush=True)
    for label, (spec, gpus) in CASES.items():
        if args.only.lower() not in label.lower():
            continue
        _, traced = analyze_file(str(ROOT / spec), device=device, solvable=True)
        options = SplitOptions(gpus=gpus, device=device,
                               memory_limit=float(device.memory_bytes), microbatches=4 * gpus)
        problem = _lowered(traced, options).problem
        exact = exact_groups(problem)
        dp_split = interval_dp(exact)
        assert dp_split is not None, label
        dp = evaluate(problem, exact.expand(dp_split)).bottleneck_s
        start = time.perf_counter()
        bound = block_bound(exact, upper_s=dp)
        seconds = time.perf_counter() - start
        if bound is None:
            print(f"| {label} | {exact.num_coarse} | {1e3 * dp:.3f} ms | none | - | "
                  f"{seconds:.2f} s | - | - |", flush=True)
            continue
        solved = "-"
        below_best = "-"
        if args.solve:
            result = partition(problem)
            best = result.report.objective
            solved = f"{result.report.status}, {1e3 * best:.3f} ms"
            below_best = f"{1 - bound / best:.2%}"
        print(f"| {label} | {exact.num_coarse} | {1e3 * dp:.3f} ms | {1e3 * bound:.3f} ms | "
              f"{1 - bound / dp:.2%} | {seconds:.2f} s | {solved} | {below_best} |", flush=True)
    print(f"\nload average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
