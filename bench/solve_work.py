"""How much CP-SAT work ``partition()`` spends on the zoo's models, in deterministic units.

Wall seconds of a solve swing with the machine's load; CP-SAT's deterministic time (the
unit ``--work-limit`` counts in, default 10 per partition) does not, so two versions of
the solver are compared by it. For each transformers family of ``bench/zoo.py`` (small
random configs, ``--layers`` per stack), the model is traced and costed as ``fxpipe split``
does, lowered onto ``--gpus`` stages (1F1B, M = 4, the h100 table entry), and partitioned;
the table gives the status, the gap, the work of each CP-SAT phase and their sum, and the
wall seconds of ``partition()``.

    python bench/solve_work.py [--layers 2] [--gpus 4] [--only falcon,t5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zoo

from fxpipe.compiler import SplitOptions, _lowered, analyze_file
from fxpipe.cost_models import get_device
from fxpipe.partition import ilp, ilp_search, partition

WORK: list[float] = []  # the deterministic time of each CP-SAT search, in order


def _counted(*args: object, **kwargs: object) -> ilp_search.Search:
    search = ilp_search.run_search(*args, **kwargs)  # type: ignore[arg-type]
    WORK.append(search.solver.deterministic_time)
    return search


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--only", help="comma-separated slugs (default: every family)")
    args = parser.parse_args()
    ilp.run_search = _counted  # StageModel.solve looks it up in its module
    families = [zoo.deeper(f, args.layers) for f in zoo.TRANSFORMERS
                if not args.only or f.slug in args.only.split(",")]
    device = get_device("h100")
    print(f"load average before {os.getloadavg()}\n")
    print("| family | nodes x stages | status | gap | CP-SAT work per phase | work | wall |")
    print("|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for family in families:
            path = Path(folder) / f"{family.slug}.py"
            path.write_text(family.source(), encoding="utf-8")
            _, traced = analyze_file(str(path), device=device, solvable=True)
            options = SplitOptions(gpus=args.gpus, device=device,
                                   memory_limit=float(device.memory_bytes), microbatches=4)
            problem = _lowered(traced, options).problem
            WORK.clear()
            start = time.perf_counter()
            result = partition(problem)
            wall = time.perf_counter() - start
            phases = ", ".join(f"{w:.2f}" for w in WORK)
            print(f"| {family.name} | {len(problem.nodes)} x {args.gpus} | "
                  f"{result.report.status} | {result.report.gap:.2%} | {phases} | "
                  f"{sum(WORK):.2f} | {wall:.1f} s |", flush=True)
    print(f"\nload average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
