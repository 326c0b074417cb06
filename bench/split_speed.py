"""End-to-end speed of ``fxpipe split`` on big models built on the meta device.

Two parts:

1. ``fxpipe split SPEC --gpus N --out TMP`` as a subprocess (so import time is the
   user's), ``--repeat`` times per model: median wall time, and from the written
   ``plan.json`` the solver status, gap, ``solver.wall_s`` (all of ``partition()``:
   baselines, coarsening, DP, CP-SAT; read from ``timing.json`` when ``plan.json``
   does not carry it), solved / graph node counts and bottleneck.
   Checked against the targets: end to end < 20 s (10 s for Llama-3-8B), OPTIMAL
   or gap <= 1 %. ``--against DIR`` runs every command also with the fxpipe of another
   checkout (e.g. a worktree of the previous commit), interleaved run by run, so both
   see the same machine load and the ratio is fair on a shared machine.
2. The same work once per model in a fresh child process, phase by phase, with the
   functions ``fxpipe.cli._run_split`` calls (import, load, trace, each analysis
   pass, roofline, lower, solve, plan, diagrams + report, codegen, write), so the
   table says where the time goes. ``--profile N`` also prints the N most expensive
   functions (cProfile, cumulative) of the whole in-process run.

    python bench/split_speed.py [--repeat 3] [--only 70B] [--against ../base] [--profile 25]

The machine may be shared: the load average (1 min) is printed next to every timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# label -> (model spec, GPUs, extra flags, end-to-end target in seconds)
MODELS: dict[str, tuple[str, int, tuple[str, ...], float]] = {
    "GPT 1.5B (48 x 1600)": ("examples/gpt.py:build_gpt_1p5b", 8, (), 20.0),
    "Llama-3-8B (32 x 4096)": ("examples/llama.py:build_llama3_8b", 8, (), 10.0),
    "HF GPT-2 XL (48 x 1600, 1024 tokens)": ("bench/hf_shapes.py:build_gpt2_xl", 8, (), 20.0),
    "HF Llama-3-8B (32 x 4096, 4096 tokens)": ("bench/hf_shapes.py:build_llama3_8b", 8, (),
                                               10.0),
    # default flags (recompute chosen per stage); onto 16 no split fits in 80 GiB: the run
    # ends with the error that says so (timed all the same)
    "HF Llama-3-70B (80 x 8192, 4096 tokens) onto 32": (
        "bench/hf_shapes.py:build_llama3_70b", 32, (), 20.0),
    "HF Llama-3-70B (80 x 8192, 4096 tokens) onto 16": (
        "bench/hf_shapes.py:build_llama3_70b", 16, (), 20.0),
}
TARGET_GAP = 0.01


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# --- part 1: end to end --------------------------------------------------------------


def split_once(spec: str, gpus: int, flags: tuple[str, ...], root: Path = ROOT) -> dict:
    with tempfile.TemporaryDirectory(prefix="fxpipe-split-speed-") as scratch:
        out = Path(scratch) / "out"
        pinned = () if "--pp" in flags else ("--pp", str(gpus))  # one pipeline, as before
        command = [sys.executable, "-m", "fxpipe.cli", "split", str(ROOT / spec), "--gpus",
                   str(gpus), *pinned, *flags, "--out", str(out)]
        load_before = loadavg()
        start = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": str(root)}
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        shown = " ".join(["fxpipe", *command[3:]]).replace(str(ROOT) + "/", "")
        if done.returncode == 2 and "fxpipe: error:" in done.stderr:  # the user's error
            nan = float("nan")
            return {"wall_s": wall, "load": (load_before + loadavg()) / 2,
                    "status": "error", "gap": nan, "solver_wall_s": nan, "solved_nodes": 0,
                    "graph_nodes": 0, "bottleneck_s": nan, "command": shown, "phases_s": {},
                    "error": done.stderr.strip().splitlines()[-1]}
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
        "command": shown,
        "phases_s": timing.get("phases_s", {}),
    }


def end_to_end(repeat: int, only: str, against: Path | None) -> list[dict]:
    print(
        f"| model | GPUs | wall (median of {repeat}) | min–max | load avg | status | gap "
        "| partition() (median) | solved / graph nodes | bottleneck | target |"
        + (" previous code: wall | status, gap | ratio |" if against else "")
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"
          + ("---:|---|---:|" if against else ""))
    rows = []
    for label, (spec, gpus, flags, target) in MODELS.items():
        if only not in label:
            continue
        runs, base = [], []
        for _ in range(repeat):  # interleaved: both codes see the same load
            runs.append(split_once(spec, gpus, flags))
            if against is not None:
                base.append(split_once(spec, gpus, flags, against))
        walls = [r["wall_s"] for r in runs]
        solves = [r["solver_wall_s"] for r in runs]
        wall, solve = statistics.median(walls), statistics.median(solves)
        statuses = sorted({r["status"] for r in runs})
        gap = max(r["gap"] for r in runs)
        last = runs[-1]
        met = wall < target and (statuses == ["OPTIMAL"] or gap <= TARGET_GAP)
        loads = [r["load"] for r in runs + base]
        line = (
            f"| {label} | {gpus} | {wall:.1f} s | {min(walls):.1f}–{max(walls):.1f} s "
            f"| {min(loads):.1f}–{max(loads):.1f} | {'/'.join(statuses)} | {gap:.2%} "
            f"| {solve:.2f} s ({min(solves):.2f}–{max(solves):.2f}) "
            f"| {last['solved_nodes']} / {last['graph_nodes']} "
            f"| {last['bottleneck_s'] * 1e3:.3f} ms "
            f"| {target:g} s, gap 1%: {'met' if met else 'MISSED'} |"
        )
        if base:
            base_wall = statistics.median(r["wall_s"] for r in base)
            base_status = "/".join(sorted({r["status"] for r in base}))
            base_gap = max(r["gap"] for r in base)
            line += (f" {base_wall:.1f} s | {base_status}, {base_gap:.2%} "
                     f"| {base_wall / wall:.2f}x |")
        print(line, flush=True)
        rows.append({"label": label, "spec": spec, "runs": runs, "base": base, "met": met})
    print()
    for row in rows:
        print(f"    {row['runs'][0]['command']}")
        for run in row["runs"] + row["base"]:
            if "error" in run:
                print(f"      {run['error']}")
                break
        phases = row["runs"][len(row["runs"]) // 2]["phases_s"]
        if phases:
            print("      phases (timing.json of one run): " + ", ".join(
                f"{name} {seconds:.1f} s" for name, seconds in phases.items()))
    return rows


# --- part 2: phases, in a fresh child ------------------------------------------------


def recompute_flag(flags: tuple[str, ...]) -> str:
    """The ``--recompute`` choice in a model's flags, as ``fxpipe split`` reads it."""
    if "--recompute" not in flags:
        return "auto"
    i = flags.index("--recompute") + 1
    return flags[i] if i < len(flags) and not flags[i].startswith("-") else "all"


def phases_child(spec: str, gpus: int, recompute: str, profile: int) -> None:
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
    from fxpipe.partition import Recompute
    from fxpipe.schedules import ScheduleKind

    mark("import fxpipe (+ ortools, rich)")

    @contextmanager
    def phase(label: str):  # type: ignore[no-untyped-def]
        mark("(between phases)")
        yield
        mark(label)

    device = get_device("h100")
    source, traced = analyze_file(spec, device=device, progress=phase)
    options = SplitOptions(gpus=gpus, device=device, memory_limit=float(device.memory_bytes),
                           microbatches=4 * gpus, schedule=ScheduleKind("1f1b"),
                           recompute=Recompute(recompute))
    plan, error = None, None
    try:
        plan = plan_split(traced, label=source.label, options=options, progress=phase)
        mark("lower + build plan")
    except ValueError as exc:  # nothing fits: the time to the user's error is timed
        error = str(exc)
        mark("finding what would fit, the error")
    if plan is not None:
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
                "solved_nodes": plan.solver.solved_nodes if plan is not None else 0,
                "solver_wall_s": plan.solver.wall_s if plan is not None else None,
                "error": error,
            }
        )
    )


def phases(only: str, profile: int) -> None:
    for label, (spec, gpus, flags, _) in MODELS.items():
        if only not in label:
            continue
        command = [
            sys.executable,
            __file__,
            "--_phases",
            spec,
            "--gpus",
            str(gpus),
            "--recompute", recompute_flag(flags),
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
        if data["error"] is not None:
            print(f"No plan: {data['error']}")
        else:
            print(f"`partition()` took {data['solver_wall_s']:.2f} s: baselines, coarsening, "
                  "the interval DP and the CP-SAT solves.")
        if profile:
            print()
            print("```")
            print(done.stderr.strip())
            print("```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--only", default="", help="models whose label contains this")
    parser.add_argument("--against", type=Path,
                        help="another checkout's root: run its fxpipe side by side")
    parser.add_argument("--skip-phases", action="store_true", help="only end to end")
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
        phases_child(args._phases, args.gpus, args.recompute, args.profile)
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
        end_to_end(args.repeat, args.only, args.against)
    if not args.skip_phases:
        phases(args.only, args.profile)


if __name__ == "__main__":
    main()
