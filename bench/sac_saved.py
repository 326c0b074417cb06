"""What selective recompute keeps: the plan's figure against torch's own SAC.

A stage the plan recomputes selectively keeps, per micro-batch in flight, the outputs of
its matmuls and fused attention kernels (``fxpipe.runtime.recompute.SELECTIVE_KEEPS``),
as the memory pass records them per node (``selective_bytes``). This sets that figure
against what torch's SAC, under the runtime's own policy (``selective_contexts``), holds
in its cache after one forward on this CPU (tests/passes/test_saved_bytes.py checks the
same at small sizes), and against what a forward without checkpointing saves:
transformers' Llama (2 layers, one micro-batch of 1 x SEQ tokens), traced as ``fxpipe
split`` traces it, at float32 or under ``--precision bf16-mixed``; then the same at each of
the model's keep levels (``fxpipe.lower.keep_levels``: SAC keeping only the outputs its
rule keeps, ``keeping``). Prints two markdown tables.

    python bench/sac_saved.py [--shapes 256:512 512:1024 1024:2048] [--precision bf16-mixed]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxpipe import meta
from fxpipe.compiler import analyze
from fxpipe.cost_models import get_device
from fxpipe.lower import keep_levels
from fxpipe.precision import parse_precision
from fxpipe.runtime.recompute import KeepRule
from tests.passes.test_saved_bytes import llama, real_saved_bytes, real_selective_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=["256:512", "512:1024", "1024:2048"],
                        help="WIDTH:TOKENS")
    parser.add_argument("--precision", default=None, help="bf16-mixed (default: float32)")
    args = parser.parse_args()
    precision = None if args.precision is None else parse_precision(args.precision)
    dtype = precision.dtype if precision is not None else None
    print(f"torch {torch.__version__}, precision {args.precision or '32-true'}, "
          f"load average before {os.getloadavg()}\n")
    mib = 2 ** 20
    levels: list[str] = []
    print("| width | tokens | full forward saves | SAC keeps | plan's selective bytes "
          "| plan / SAC | SAC / full |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        width, seq = (int(v) for v in shape.split(":"))
        traced = llama(width, seq)
        analyze(traced, device=get_device("cpu"), precision=precision)
        planned = sum(info.selective_bytes for n in traced.gm.graph.nodes
                      if (info := meta.BYTES.get(n)) is not None)
        full = real_saved_bytes(traced, dtype)
        kept = real_selective_bytes(traced, dtype)
        print(f"| {width} | {seq} | {full / mib:.2f} MiB | {kept / mib:.2f} MiB | "
              f"{planned / mib:.2f} MiB | {planned / kept:.4f} | {kept / full:.2f} |",
              flush=True)
        entries = [k for n in traced.gm.graph.nodes if (info := meta.BYTES.get(n)) is not None
                   for k in info.selective]
        for level in keep_levels(entries):
            rule = KeepRule(*level)
            at = sum(k.nbytes for k in entries if rule.keeps(k.work, k.width))
            real = real_selective_bytes(traced, dtype, rule)
            levels.append(f"| {width} | {seq} | {level} | {real / mib:.2f} MiB | "
                          f"{at / mib:.2f} MiB | {at / real:.4f} | {real / full:.2f} |")
    print("\n| width | tokens | keep level (work, width) | SAC keeps | plan | plan / SAC "
          "| SAC / full |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(levels))
    print(f"\nload average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
