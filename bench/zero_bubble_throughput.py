"""Predicted throughput of the zero-bubble schedules against 1F1B and interleaved 1F1B.

For each model, traces and analyses it once (roofline on ``--device``), then plans it
for each schedule at the same memory limit (the device's memory), as ``fxpipe split``
would with

    --gpus N --microbatches M --schedule S [--virtual-stages 2]

and prints one markdown row per (model, GPUs, schedule): the predicted bottleneck
(per micro-batch, the slowest GPU), iteration time, throughput (M / iteration) and its
gain over 1F1B, the bubble (idle share of the step), the largest GPU's memory, the
solver's status and gap and the wall time. A schedule no split of which fits is a row
saying so, with what the leanest split found needs (the Llama-3-70B shape's Adam state
alone is more than 80 GiB a GPU on 8 GPUs); ``--memory-limit`` sets another limit for
every schedule alike.

Models (on the meta device, nothing allocated): GPT-2 small with its tied head, the
Llama-3-8B shape and the Llama-3-70B shape (``examples/``).

    python bench/zero_bubble_throughput.py [--gpus 8 16] [--time-limit 30] [--only ...]
        [--memory-limit 192GiB]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import analysed_models, plan_cells, timed_plan  # noqa: E402
from fxpipe.compiler import SplitOptions  # noqa: E402
from fxpipe.cost_models import get_device  # noqa: E402
from fxpipe.partition.errors import InfeasibleMemoryError  # noqa: E402
from fxpipe.schedules import ScheduleKind  # noqa: E402
from fxpipe.units import format_bytes, parse_bytes  # noqa: E402

MODELS = {
    "GPT-2 small": "examples/gpt.py:build_gpt2_small",
    "Llama-3-8B": "examples/llama.py:build_llama3_8b",
    "Llama-3-70B": "examples/llama.py:build_llama3_70b",
}
# (label, schedule, virtual stages)
LAYOUTS = [
    ("1f1b", ScheduleKind.ONE_F_ONE_B, 1),
    ("interleaved v=2", ScheduleKind.INTERLEAVED, 2),
    ("zb1p", ScheduleKind.ZB1P, 1),
    ("zbv", ScheduleKind.ZBV, 2),
    ("dualpipev", ScheduleKind.DUALPIPEV, 2),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--microbatches-per-gpu", type=int, default=2,
                        help="M = this x GPUs (default 2: M = 2N, DualPipeV's least)")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--only", nargs="*", default=None, help="model labels to run")
    parser.add_argument("--memory-limit", type=parse_bytes, default=None,
                        help="bytes per GPU, e.g. 192GiB (default: the device's memory)")
    args = parser.parse_args()
    device = get_device(args.device)
    limit = float(device.memory_bytes if args.memory_limit is None else args.memory_limit)
    print(f"{platform.node()}, python {platform.python_version()}, {device.name}, "
          f"limit {format_bytes(limit)} per GPU, time limit "
          f"{args.time_limit:g} s, load {_load()}\n")
    print("| model | GPUs | M | schedule | bottleneck | iteration | throughput | vs 1f1b "
          "| bubble (step) | max memory | fits | solver | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, traced in analysed_models(MODELS, args.only, device):
        for gpus in args.gpus:
            m = args.microbatches_per_gpu * gpus
            base = None
            for name, schedule, v in LAYOUTS:
                options = SplitOptions(
                    gpus=gpus, device=device, memory_limit=limit,
                    microbatches=m, schedule=schedule, virtual_stages=v,
                    time_limit_s=args.time_limit)
                plan, wall_s = timed_plan(traced, label, options)
                if isinstance(plan, ValueError):  # no split: say so in the table
                    print(f"| {label} | {gpus} | {m} | {name} | - | - | - | - | - | "
                          f"{_no_split_cells(plan)} | {wall_s:.1f} s |", flush=True)
                    continue
                e = plan.estimate
                throughput = m / e.iteration_s
                if schedule is ScheduleKind.ONE_F_ONE_B:
                    base = throughput
                gain = f"{throughput / base - 1:+.1%}" if base else "-"
                print(
                    f"| {label} | {gpus} | {m} | {name} | {e.bottleneck_s * 1e3:.3f} ms | "
                    f"{e.iteration_s * 1e3:.2f} ms | {throughput:.2f} mb/s | {gain} | "
                    f"{e.bubble_fraction:.1%} | {plan_cells(plan, wall_s)}", flush=True)
    print(f"\nload at the end {_load()}")
    return 0


def _no_split_cells(error: ValueError) -> str:
    """The max memory, fits and solver cells of a row with no plan: for memory, what the
    leanest split found needs (no split fitting is proved: by the parameters' state alone,
    or by the solver), else the error's own sentence."""
    if isinstance(error, InfeasibleMemoryError):
        return f"leanest needs {format_bytes(error.needed)} | no | INFEASIBLE (proved)"
    return f"- | no split: {error} | -"


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
