"""Interleaved programs (v stage modules per GPU) on the Hugging Face shapes: how close
``fxpipe split`` gets to proving them, and how long ``partition()`` takes.

Each case is ``fxpipe split SPEC --gpus N --schedule interleaved --virtual-stages v``,
or ``--schedule zbv`` (two stage modules per GPU in a V; the target is issue 18's for
the interleaved cases), with default flags otherwise, run as a subprocess
(``split_speed.split_once``); the table gives the solver's status and gap,
``partition()``'s wall time (``solver.wall_s`` of plan.json), the bottleneck, the
end-to-end wall time and the load average. Target: OPTIMAL or gap <= 1 % within 60 s
of solving. ``--against DIR`` runs every case also
with the fxpipe of another checkout, run by run, so both see the same load.

    python bench/interleaved_solve.py [--repeat 1] [--only gpt2] [--against ../base]

The search is bounded by CP-SAT's deterministic time, so the plans (and gaps) are the
same at any load; only the seconds depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from split_speed import ROOT, TARGET_GAP, split_once

# label -> (model spec, GPUs, schedule flags)
CASES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    f"HF {name}, {how}": (f"bench/hf_shapes.py:build_{model}", 8, flags)
    for name, model in (("Llama-3-8B", "llama3_8b"), ("GPT-2 XL", "gpt2_xl"))
    for how, flags in (
        ("v = 2", ("--schedule", "interleaved", "--virtual-stages", "2")),
        ("v = 4", ("--schedule", "interleaved", "--virtual-stages", "4")),
        ("ZB-V", ("--schedule", "zbv")),  # not a target of its own: a V, two per GPU
    )
}
SOLVE_TARGET_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", default="", help="cases whose label contains this")
    parser.add_argument("--against", type=Path, help="another checkout to compare with")
    args = parser.parse_args()
    roots = [("this", ROOT)] + ([("against", args.against.resolve())] if args.against else [])
    print("| case | code | status | gap | partition() (median) | bottleneck | wall (median) "
          "| load | target |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    commands: list[str] = []
    for label, (spec, gpus, flags) in CASES.items():
        if args.only.lower() not in label.lower():
            continue
        runs: dict[str, list[dict]] = {name: [] for name, _ in roots}
        for _ in range(args.repeat):
            for name, root in roots:
                try:
                    runs[name].append(split_once(spec, gpus, flags, root))
                except SystemExit as failed:  # a crash after solving (drawing, writing)
                    print(f"| {label} onto {gpus} | {name} | failed: "
                          f"{str(failed).splitlines()[-1][:120]} |", flush=True)
        for name, _ in roots:
            done = runs[name]
            if not done:
                continue
            last = done[-1]
            solve = statistics.median(r["solver_wall_s"] for r in done)
            met = solve <= SOLVE_TARGET_S and (last["status"] == "OPTIMAL"
                                               or last["gap"] <= TARGET_GAP)
            print(f"| {label} onto {gpus} | {name} | {last['status']} | "
                  f"{100 * last['gap']:.2f}% | {solve:.1f} s | "
                  f"{1000 * last['bottleneck_s']:.2f} ms | "
                  f"{statistics.median(r['wall_s'] for r in done):.1f} s | "
                  f"{min(r['load'] for r in done):.1f}–{max(r['load'] for r in done):.1f} | "
                  f"{'met' if met else 'MISSED'} |", flush=True)
            commands.append(last["command"])
    print("\ncommands (this code):", *dict.fromkeys(commands[::len(roots)]), sep="\n  ")


if __name__ == "__main__":
    main()
