"""Predicted throughput per schedule: the same model on 8 GPUs under every schedule fxpipe plans.

For each model, traces and analyses it once (roofline on ``--device``), then runs the
partitioner for each schedule, as ``fxpipe split`` would with

    --gpus 8 --microbatches M [--schedule S] [--virtual-stages V] [--replicate]

and prints one markdown row per schedule: the predicted bottleneck (per micro-batch,
the slowest GPU), iteration time, throughput (M / iteration), the bubble with both of
its definitions, the largest GPU's memory, and the solver's status, gap and wall time.
A schedule whose plan does not fit the memory limit is reported as such, not dropped.

Models (built on the meta device, nothing allocated): GPT-2 small with its tied
50,257-token head (``examples/gpt.py:build_gpt2_small``) and Llama-3-8B
(``examples/llama.py:build_llama3_8b``).

    python bench/schedule_throughput.py [--gpus 8] [--microbatches 16] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import analysed_models, plan_cells, timed_plan  # noqa: E402
from fxpipe.compiler import SplitOptions  # noqa: E402
from fxpipe.cost_models import get_device  # noqa: E402
from fxpipe.schedules import ScheduleKind  # noqa: E402

MODELS = {
    "GPT-2 small (tied head)": "examples/gpt.py:build_gpt2_small",
    "Llama-3-8B": "examples/llama.py:build_llama3_8b",
}
# (label, schedule, virtual stages, replicate)
LAYOUTS = [
    ("gpipe", ScheduleKind.GPIPE, 1, False),
    ("1f1b", ScheduleKind.ONE_F_ONE_B, 1, False),
    ("pipedream (weight stashing)", ScheduleKind.PIPEDREAM, 1, False),
    ("interleaved v=2", ScheduleKind.INTERLEAVED, 2, False),
    ("interleaved v=4", ScheduleKind.INTERLEAVED, 4, False),
    ("1f1b + replicated stages", ScheduleKind.ONE_F_ONE_B, 1, True),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--device", default="h100")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--only", nargs="*", default=None, help="model labels to run")
    args = parser.parse_args()
    device = get_device(args.device)
    print(f"{platform.node()}, python {platform.python_version()}, {args.gpus} x "
          f"{device.name}, M = {args.microbatches}, time limit {args.time_limit:g} s\n")
    print("| model | schedule | config | bottleneck | iteration | throughput | bubble "
          "(step) | bubble (ideal) | max memory | fits | solver | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, traced in analysed_models(MODELS, args.only, device):
        for name, schedule, v, replicate in LAYOUTS:
            options = SplitOptions(
                gpus=args.gpus, device=device, memory_limit=float(device.memory_bytes),
                microbatches=args.microbatches, schedule=schedule, virtual_stages=v,
                replicate=replicate, time_limit_s=args.time_limit)
            plan, wall_s = timed_plan(traced, label, options)
            if isinstance(plan, ValueError):  # no split fits: say so in the table
                print(f"| {label} | {name} | - | - | - | - | - | - | - | no: {plan} | - | "
                      f"{wall_s:.1f} s |")
                continue
            e = plan.estimate
            print(
                f"| {label} | {name} | {plan.configuration if replicate else '-'} | "
                f"{e.bottleneck_s * 1e3:.3f} ms | {e.iteration_s * 1e3:.2f} ms | "
                f"{plan.microbatches / e.iteration_s:.1f} mb/s | {e.bubble_fraction:.1%} | "
                f"{e.bubble_ratio:.1%} | {plan_cells(plan, wall_s)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
