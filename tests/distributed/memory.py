"""Peak RSS per rank when each rank materializes only its own stage.

    python -m tests.distributed.memory [--factory build_large] [--stages 4]

Builds the plan on a meta model, writes the whole model's checkpoint from a
separate process (its peak RSS is the "whole model" reference), then trains one
step under torchrun --nproc-per-node K with --checkpoint and prints, per rank,
the peak RSS before the stage is materialized, after it is loaded, and after
the step, next to the whole model's size. Used by test_memory.py (small
factory) and BENCHMARKS.md (build_large).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fxpipe.frontend import trace

from ._helpers import contiguous_plan, torchrun, write_package

MODEL_FILE = Path(__file__).resolve().with_name("wide_mlp.py")
MiB = 2**20

_SAVE_FULL = """
import json, resource, sys, torch
sys.path.insert(0, {dir!r})
import wide_mlp
model = getattr(wide_mlp, {factory!r})()
torch.save(model.state_dict(), {path!r})
size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps({{"bytes": size, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                  * 1024}}))
"""


def measure(directory: Path, factory: str = "build_model", stages: int = 4) -> dict:
    sys.path.insert(0, str(MODEL_FILE.parent))
    import wide_mlp

    build = getattr(wide_mlp, factory)
    with torch.device("meta"):
        model = build()
    example = getattr(build, "example_inputs", wide_mlp.example_inputs)()
    traced = trace(model, example, {})
    plan = contiguous_plan(traced.gm.graph, stages, schedule="1f1b", microbatches=stages)
    write_package(directory / "pkg", traced, plan)
    checkpoint = directory / "model.pt"
    script = _SAVE_FULL.format(dir=str(MODEL_FILE.parent), factory=factory, path=str(checkpoint))
    full = json.loads(subprocess.run([sys.executable, "-c", script], check=True,
                                     capture_output=True, text=True).stdout)
    result = torchrun(stages, directory / "pkg" / "train_torchrun.py",
                      "--model", f"{MODEL_FILE}:{factory}", "--checkpoint", str(checkpoint),
                      "--save", str(directory / "out"), "--lr", "0")
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-4000:] + result.stderr[-8000:])
    ranks = []
    for r in range(stages):
        saved = torch.load(directory / "out" / f"rank{r}.pt")
        stage_bytes = sum(g.numel() * g.element_size() for g in saved["grads"].values())
        ranks.append({"rank": r, "stage_bytes": stage_bytes, **saved["rss"]})
    return {"model_bytes": full["bytes"], "full_process_peak_rss": full["peak_rss"],
            "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--factory", default="build_model")
    parser.add_argument("--stages", type=int, default=4)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = measure(Path(tmp), opts.factory, opts.stages)
    print(f"whole model: {report['model_bytes'] / MiB:.0f} MiB of parameters; a process "
          f"that builds it and saves the checkpoint peaks at "
          f"{report['full_process_peak_rss'] / MiB:.0f} MiB RSS")
    print("| rank | stage params | peak RSS: before stage | after load | after step |")
    print("|---:|---:|---:|---:|---:|")
    for r in report["ranks"]:
        print(f"| {r['rank']} | {r['stage_bytes'] / MiB:.0f} MiB | {r['built'] / MiB:.0f} MiB "
              f"| {r['loaded'] / MiB:.0f} MiB | {r['step'] / MiB:.0f} MiB |")


if __name__ == "__main__":
    main()
