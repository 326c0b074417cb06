"""End-to-end ``fxpipe profile`` of models built on the meta device.

Runs each command as a subprocess (so import time and peak memory are the user's),
three times, and prints a markdown table of the median wall time and the peak RSS
(``ru_maxrss`` of each child, from ``os.wait4``).

    python bench/trace_meta.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
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


def run_once(spec: str) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes of this child) for one ``fxpipe profile --json``."""
    command = [sys.executable, "-m", "fxpipe.cli", "profile", spec, "--json"]
    with tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        # wait4 gives this child's own rusage; RUSAGE_CHILDREN's ru_maxrss is the running
        # maximum over every child so far, which would hide a smaller later model.
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            stderr.seek(0)
            raise SystemExit(f"{' '.join(command)} failed:\n{stderr.read()[-2000:]}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}"
    )
    print()
    print(f"| model | command | wall time (median of {args.repeat}) | peak RSS |")
    print("|---|---|---:|---:|")
    for label, spec in MODELS.items():
        walls, peaks = [], []
        for _ in range(args.repeat):
            wall, peak = run_once(spec)
            walls.append(wall)
            peaks.append(peak)
        print(
            f"| {label} | `fxpipe profile {spec}` | {statistics.median(walls):.1f} s "
            f"(min {min(walls):.1f}, max {max(walls):.1f}) | {max(peaks) / 2**20:.0f} MiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
