"""End-to-end speed of ``fxpipe split`` on two big models built on the meta device.

Two parts:

1. ``fxpipe split SPEC --gpus 8 --out TMP`` as a subprocess (so import time is the
   user's), ``--repeat`` times per model: median wall time, and from the written
   ``plan.json`` the solver status, gap, ``solver.wall_s`` (all of ``partition()``:
   baselines, coarsening, DP, CP-SAT; read from ``timing.json`` when ``plan.json``
   does not carry it), solved / graph node counts and bottleneck.
   Checked against the targets: end to end < 20 s, OPTIMAL with gap <= 1 %,
   solve < 3 s.
2. The same work once per model in a fresh child process, phase by phase, with the
   functions ``fxpipe.cli._run_split`` calls (import, load, trace, each analysis
   pass, roofline, lower, solve, plan, diagrams + report, codegen, write), so the
   table says where the time goes. ``--profile N`` also prints the N most expensive
   functions (cProfile, cumulative) of the whole in-process run.

    python bench/split_speed.py [--repeat 3] [--gpus 8] [--profile 25]

The machine may be shared: the load average (1 min) is printed next to every timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "GPT 1.5B (48 x 1600)": "examples/gpt.py:build_gpt_1p5b",
    "Llama-3-8B (32 x 4096)": "examples/llama.py:build_llama3_8b",
}
TARGET_WALL_S = 20.0
TARGET_SOLVE_S = 3.0
TARGET_GAP = 0.01


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def fxpipe_command() -> list[str]:
    script = Path(sys.executable).parent / "fxpipe"
    if script.exists():
        return [str(script)]
    found = shutil.which("fxpipe")
    return [found] if found else [sys.executable, "-m", "fxpipe.cli"]


# --- part 1: end to end --------------------------------------------------------------


def split_once(spec: str, gpus: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fxpipe-split-speed-") as scratch:
        out = Path(scratch) / "out"
        command = [*fxpipe_command(), "split", spec, "--gpus", str(gpus), "--out", str(out)]
        load_before = loadavg()
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        plan = json.loads((out / "plan.json").read_text())
        timing_file = out / "timing.json"
        timing = json.loads(timing_file.read_text()) if timing_file.exists() else {}
    solver = plan["solver"]
    # solver.wall_s lived in plan.json; newer versions write it to timing.json so that
    # plan.json is reproducible byte for byte.
    solver_wall = solver.get("wall_s", timing.get("solver_wall_s"))
    if solver_wall is None:
        raise SystemExit("neither plan.json solver.wall_s nor timing.json solver_wall_s found")
    objective, bound = solver["objective"], solver["bound"]
    return {
        "wall_s": wall,
        "load": (load_before + loadavg()) / 2,
        "status": solver["status"],
        "gap": solver.get("gap", max(0.0, (objective - bound) / objective) if objective else 0.0),
        "solver_wall_s": solver_wall,
        "solved_nodes": solver["solved_nodes"],
        "graph_nodes": solver["graph_nodes"],
        "bottleneck_s": plan["estimate"]["bottleneck_s"],
        "command": " ".join(["fxpipe", *command[len(fxpipe_command()) :]]),
    }


def end_to_end(repeat: int, gpus: int) -> list[dict]:
    print(
        f"| model | wall (median of {repeat}) | min–max | load avg | solver status | gap "
        "| solver.wall_s (median) | solved / graph nodes | bottleneck | targets |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---|")
    rows = []
    for label, spec in MODELS.items():
        runs = [split_once(spec, gpus) for _ in range(repeat)]
        walls = [r["wall_s"] for r in runs]
        solves = [r["solver_wall_s"] for r in runs]
        wall, solve = statistics.median(walls), statistics.median(solves)
        statuses = sorted({r["status"] for r in runs})
        gap = max(r["gap"] for r in runs)
        last = runs[-1]
        met = {
            f"e2e < {TARGET_WALL_S:g} s": wall < TARGET_WALL_S,
            "OPTIMAL, gap <= 1%": statuses == ["OPTIMAL"] and gap <= TARGET_GAP,
            f"solve < {TARGET_SOLVE_S:g} s": solve < TARGET_SOLVE_S,
        }
        verdict = ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in met.items())
        loads = [r["load"] for r in runs]
        print(
            f"| {label} | {wall:.1f} s | {min(walls):.1f}–{max(walls):.1f} s "
            f"| {min(loads):.1f}–{max(loads):.1f} | {'/'.join(statuses)} | {gap:.2%} "
            f"| {solve:.2f} s ({min(solves):.2f}–{max(solves):.2f}) "
            f"| {last['solved_nodes']} / {last['graph_nodes']} "
            f"| {last['bottleneck_s'] * 1e3:.3f} ms | {verdict} |",
            flush=True,
        )
        rows.append({"label": label, "spec": spec, "runs": runs, "met": met})
    print()
    for row in rows:
        print(f"    {row['runs'][0]['command']}")
    return rows


# --- part 2: phases, in a fresh child ------------------------------------------------


def phases_child(spec: str, gpus: int, profile: int) -> None:
    """Runs in a fresh interpreter: time each phase of ``_run_split``, print JSON."""
    timings: list[tuple[str, float]] = []
    t0 = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t0
        now = time.perf_counter()
        timings.append((name, now - t0))
        t0 = now

    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()

    import torch  # noqa: F401

    mark("import torch")
    from contextlib import contextmanager

    from fxpipe.compiler import SplitOptions, analyze_file, output_files, plan_split
    from fxpipe.cost_models import get_device
    from fxpipe.output import write_folder
    from fxpipe.partition import Schedule

    mark("import fxpipe (+ ortools, rich)")

    @contextmanager
    def phase(label: str):  # type: ignore[no-untyped-def]
        mark("(between phases)")
        yield
        mark(label)

    device = get_device("h100")
    source, traced = analyze_file(spec, device=device, progress=phase)
    options = SplitOptions(gpus=gpus, device=device, memory_limit=float(device.memory_bytes),
                           microbatches=4 * gpus, schedule=Schedule("1f1b"))
    plan = plan_split(traced, label=source.label, options=options, progress=phase)
    mark("lower + build plan")
    files = output_files(traced, plan, label=source.label, progress=phase)
    mark("plan.json, report.md, partition.dot")
    with tempfile.TemporaryDirectory(prefix="fxpipe-split-phases-") as scratch:
        write_folder(Path(scratch) / "out", files, force=False)
    mark("write folder")
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).sort_stats("cumulative").print_stats(profile)
        sys.stderr.write(buffer.getvalue())
    print(
        json.dumps(
            {
                "timings": [(name, t) for name, t in timings if name != "(between phases)"
                            or t > 0.05],
                "nodes": len(traced.gm.graph.nodes),
                "solved_nodes": plan.solver.solved_nodes,
                "solver_wall_s": plan.solver.wall_s,
            }
        )
    )


def phases(gpus: int, profile: int) -> None:
    for label, spec in MODELS.items():
        command = [
            sys.executable,
            __file__,
            "--_phases",
            spec,
            "--gpus",
            str(gpus),
            "--profile",
            str(profile),
        ]
        load_before = loadavg()
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        total = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        data = json.loads(done.stdout.strip().splitlines()[-1])
        measured = sum(seconds for _, seconds in data["timings"])
        print()
        print(
            f"**{label}** (`{spec}`, {data['nodes']} traced nodes, {data['solved_nodes']} "
            f"solved; load avg "
            f"{load_before:.1f}–{loadavg():.1f}), one in-process run:"
        )
        print()
        print("| phase | seconds | share |")
        print("|---|---:|---:|")
        for name, seconds in data["timings"]:
            print(f"| {name} | {seconds:.2f} | {seconds / total:.0%} |")
        rest = total - measured
        print(f"| interpreter start-up and exit | {rest:.2f} | {rest / total:.0%} |")
        print(f"| **total (child wall)** | **{total:.2f}** | |")
        print()
        print(
            f"`partition()` took {data['solver_wall_s']:.2f} s: baselines, coarsening, the "
            "interval DP and the CP-SAT solves."
        )
        if profile:
            print()
            print("```")
            print(done.stderr.strip())
            print("```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="print the N most expensive functions of the phase run (cProfile)",
    )
    parser.add_argument("--skip-e2e", action="store_true", help="only the phase breakdown")
    parser.add_argument("--_phases", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._phases:
        phases_child(args._phases, args.gpus, args.profile)
        return
    import torch

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}; "
        f"load average at start {Path('/proc/loadavg').read_text().split()[:3]}"
    )
    import fxpipe

    print(f"fxpipe from {Path(fxpipe.__file__).parent}")

    print()
    if not args.skip_e2e:
        end_to_end(args.repeat, args.gpus)
    phases(args.gpus, args.profile)


if __name__ == "__main__":
    main()
