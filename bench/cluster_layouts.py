"""The cluster search against the layouts people pick by hand, on a Llama-3-70B shape.

The model (bench/hf_shapes.py, 80 layers, 8192 tokens per sequence, bf16-mixed, on the
meta device) is traced and costed once; then, under the same cost model, with the same
global batch (the default: 4 x --gpus sequences):

- fxpipe's layout (``--pp auto``: the search over every pipeline degree);
- each hand-picked pipeline degree p (``--pp p``, FSDP over the rest) with fxpipe's cuts,
  and with torchtitan's layer-count split of that p (the plan's uniform-layers baseline,
  plus the same gradient sync), as a user picking the degree by hand would run it;
- pure FSDP (p = 1), where it fits;
- the chosen layout with ``--recompute all`` against ``auto``;
- the search again with every op at each ``--efficiency`` of the roofline's speed (a
  training step on an H100 / H200 measured 0.63 and 0.54 of it, docs/benchmarks/gpu.md),
  and, where it chooses another layout, the roofline's choice at that efficiency;
- the model onto ``--few`` GPUs (8: one host), where no layout fits: the one line it says.

    python bench/cluster_layouts.py [--gpus 64] [--gpus-per-node 8] [--spec SPEC]

Prints one table: predicted step, per-GPU memory, fits, and the planning time of each.
The machine may be shared: the load average (1 min) is printed with the timings.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

from fxpipe.compiler import analyze_file, plan_split
from fxpipe.cost_models import get_device
from fxpipe.options import ClusterOptions, SplitOptions
from fxpipe.partition import Recompute
from fxpipe.precision import parse_precision
from fxpipe.units import format_bytes

SPEC = "bench/hf_shapes.py:build_llama3_70b_8k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--spec", default=SPEC)
    parser.add_argument("--pp", type=int, nargs="*", default=[4, 8, 16, 32])
    parser.add_argument("--efficiency", type=float, nargs="*", default=[0.63, 0.54])
    parser.add_argument("--few", type=int, default=8)
    parser.add_argument("--only-few", action="store_true", help="only the --few line")
    args = parser.parse_args()

    device = get_device("h100")
    precision = parse_precision("bf16-mixed")
    start = time.perf_counter()
    source, traced = analyze_file(args.spec, device=device, precision=precision)
    print(f"traced and costed in {time.perf_counter() - start:.1f} s "
          f"(load {os.getloadavg()[0]:.1f})")
    base = SplitOptions(gpus=args.gpus, device=device, memory_limit=float(device.memory_bytes),
                        microbatches=4 * args.gpus, precision=precision,
                        cluster=ClusterOptions(gpus_per_node=args.gpus_per_node))

    rows: list[tuple[str, ...]] = []
    print(f"{args.spec} onto {args.gpus} GPUs ({args.gpus_per_node} per host), bf16-mixed, "
          f"global batch {4 * args.gpus} sequences")
    print("| layout | predicted step | max memory per GPU | fits | planned in | note |")
    print("|---|---|---|---|---|---|", flush=True)

    def run(label: str, options: SplitOptions) -> None:
        before = len(rows)
        plan_one(label, options)
        for row in rows[before:]:  # each row as it comes: a run of many minutes
            print("| " + " | ".join(row) + " |", flush=True)

    def plan_one(label: str, options: SplitOptions) -> None:
        began = time.perf_counter()
        try:
            plan = plan_split(traced, label=source.label, options=options)
        except ValueError as exc:
            rows.append((label, "-", "-", "no", f"{time.perf_counter() - began:.1f} s",
                         str(exc).split(";")[0][:70]))
            return
        layout = plan.layout
        assert layout is not None
        took = f"{time.perf_counter() - began:.1f} s"
        rows.append((label, f"{layout.step_s:.2f} s", format_bytes(plan.estimate.max_memory),
                     "yes" if plan.estimate.fits else "NO", took,
                     f"pp {layout.pp} x dp {layout.dp} ({layout.dp_mode}), "
                     f"{plan.solver.status}"))
        uniform = plan.baselines.get("uniform-layers")
        if uniform is not None and label.startswith("hand"):
            step = uniform.iteration_s + layout.sync_s
            rows.append((f"{label}, layer-count cuts", f"{step:.2f} s",
                         format_bytes(uniform.max_memory), "yes" if uniform.fits else "NO", "",
                         "torchtitan-style: equal layers per stage"))

    if args.few:
        began = time.perf_counter()
        try:
            plan_split(traced, label=source.label, options=replace(
                base, gpus=args.few, microbatches=4 * args.few,
                cluster=ClusterOptions(gpus_per_node=min(args.few, args.gpus_per_node))))
            said = "it fits"
        except ValueError as exc:
            said = str(exc)
        print(f"onto {args.few} GPUs ({time.perf_counter() - began:.1f} s, load "
              f"{os.getloadavg()[0]:.1f}): {said}", flush=True)
        if args.only_few:
            return
    run("fxpipe --pp auto", base)
    chosen = rows[0][5].split(" ")[1] if rows and rows[0][1] != "-" else None
    for p in args.pp:
        run(f"hand: --pp {p}", replace(base, cluster=replace(base.cluster, pp=p,
                                                              dp_mode="fsdp")))
    run("pure FSDP (--pp 1)", replace(base, cluster=replace(base.cluster, pp=1,
                                                             dp_mode="fsdp")))
    if chosen is not None:
        run(f"--pp {chosen}, --recompute all",
            replace(base, recompute=Recompute.FULL,
                    cluster=replace(base.cluster, pp=int(chosen), dp_mode="fsdp")))
    for efficiency in args.efficiency:
        at = replace(base.cluster, compute_efficiency=efficiency)
        before = len(rows)
        run(f"fxpipe --pp auto, compute at {efficiency:.2f}", replace(base, cluster=at))
        again = rows[before][5].split(" ")[1] if rows[before][1] != "-" else None
        if chosen is not None and again is not None and again != chosen:
            run(f"--pp {chosen} (the roofline's choice) at {efficiency:.2f}",
                replace(base, cluster=replace(at, pp=int(chosen), dp_mode="fsdp")))
    print(f"(load {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
