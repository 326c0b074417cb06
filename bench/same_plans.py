"""Dump what a change must leave as it was: plan.json, report.md and a digest of the
generated code of a list of splits, into one folder per split, to diff against the same
dump made from another checkout (``main`` in a second worktree, say)::

    PYTHONPATH=$PWD python bench/same_plans.py /tmp/after            # this checkout
    (cd ../main && PYTHONPATH=$PWD python bench/same_plans.py /tmp/before)
    diff -r /tmp/before /tmp/after                                  # nothing: the same

The splits: every example onto 4 and 8 GPUs, GPipe's Transformer-L 103 / 8 and 415 / 32
under GPipe's schedule, and 1,663 / 128 under 1F1B (``--only NAME ...`` picks some).
Each runs ``fxpipe split`` from the checkout the script is in (timing.json, the only file
that differs run to run, is left out); ``times.txt`` notes each split's wall and CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("gpt", "hf_bert", "hf_gpt2", "hf_llama", "hf_t5", "hf_vit", "llama", "mlp",
            "resnet", "unet")
GPIPE = ("--memory 16GiB --optimizer sgd-momentum --recompute all --device v100")
SPLITS = {
    **{f"{name}-{gpus}": f"examples/{name}.py --gpus {gpus} --pp {gpus}"
       for name in EXAMPLES for gpus in (4, 8)},
    "gpipe-103": f"bench/gpipe_transformer.py:layers_103 --gpus 8 --pp 8 {GPIPE} --schedule gpipe "
                 "--microbatches 32",
    "gpipe-415": f"bench/gpipe_transformer.py:layers_415 --gpus 32 --pp 32 {GPIPE} "
                 "--schedule gpipe --microbatches 32",
    "gpipe-1663": f"bench/gpipe_transformer.py:layers_1663 --gpus 128 --pp 128 {GPIPE} "
                  "--schedule 1f1b --microbatches 128",
}


def dump(name: str, out: Path) -> str:
    """Run split ``name`` and keep its plan, report and code digest under ``out/name``;
    the line for times.txt."""
    with tempfile.TemporaryDirectory() as scratch:
        package = Path(scratch) / "pkg"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "fxpipe.cli", "split", *SPLITS[name].split(),
             "--out", str(package)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, check=False)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        kept = out / name
        kept.mkdir(parents=True, exist_ok=True)
        # a failure's message is kept; a success's progress lines carry times
        failed = f"\n{done.stderr[-2000:]}" if done.returncode else ""
        (kept / "exit.txt").write_text(f"{done.returncode}{failed}\n")
        code = hashlib.sha256()
        for path in sorted(package.rglob("*")) if package.exists() else []:
            if path.name in ("plan.json", "report.md"):
                shutil.copy(path, kept / path.name)
            elif path.suffix == ".py":
                code.update(str(path.relative_to(package)).encode() + path.read_bytes())
        (kept / "code.sha256").write_text(code.hexdigest() + "\n")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return f"{name}: wall {wall:.1f} s, CPU {cpu:.1f} s, exit {done.returncode}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to dump into")
    parser.add_argument("--only", nargs="+", choices=sorted(SPLITS), help="these splits")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or SPLITS:
        line = dump(name, args.out)
        print(line, flush=True)
        with open(args.out / "times.txt", "a", encoding="utf-8") as times:
            times.write(line + "\n")


if __name__ == "__main__":
    main()
