"""Plan a list of models and keep each plan.json and report.md, to diff two checkouts.

    PYTHONPATH=$PWD python bench/plan_dump.py OUT [--only NAME ...]

runs ``fxpipe split`` (the fxpipe on PYTHONPATH) for each command of COMMANDS, one at a
time, and copies its plan.json and report.md to OUT/NAME/ (timing.json, which holds wall
clocks, is left out), and the exit code and, for a refusal (which writes no plan), its
message to OUT/NAME/said.txt. Run it in two worktrees (say one at main)
and ``diff -r`` the folders: a change meant to keep the answers keeps them byte for byte
where the solver proved its plan, and says which moved where it did not.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GPIPE = ("--memory", "16GiB", "--optimizer", "sgd-momentum", "--recompute", "all",
         "--device", "v100")
EXAMPLES = ("gpt", "llama", "mlp", "resnet", "unet", "hf_gpt2", "hf_llama", "hf_bert")

# the console script's entry, on the fxpipe that PYTHONPATH finds
CLI = "import sys; from fxpipe.cli import main; sys.exit(main(sys.argv[1:]))"

COMMANDS: dict[str, tuple[str, ...]] = {
    **{f"{name}-{gpus}": (f"examples/{name}.py", "--gpus", str(gpus))
       for name in EXAMPLES for gpus in (4, 8)},
    "gpipe-103-8": ("bench/gpipe_transformer.py:layers_103", "--gpus", "8", *GPIPE,
                    "--schedule", "gpipe", "--microbatches", "32"),
    "gpipe-415-32": ("bench/gpipe_transformer.py:layers_415", "--gpus", "32", *GPIPE,
                     "--schedule", "1f1b", "--microbatches", "128"),
    "gpipe-1663-128": ("bench/gpipe_transformer.py:layers_1663", "--gpus", "128", *GPIPE,
                       "--schedule", "1f1b", "--microbatches", "128"),
}


def dump(name: str, args: tuple[str, ...], out: Path) -> None:
    """Plan one command into OUT/NAME (see the module docstring)."""
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([sys.executable, "-c", CLI, "split", *args, "--out", f"{tmp}/plan"],
                             capture_output=True, text=True, check=False)
        for file in ("plan.json", "report.md"):
            if (Path(tmp) / "plan" / file).exists():
                shutil.copy(Path(tmp) / "plan" / file, target / file)
    lines = run.stderr.strip().splitlines()
    said = lines[-1] if run.returncode and lines else ""  # a refusal's message (no clocks)
    (target / "said.txt").write_text(f"exit {run.returncode}\n{said}\n")
    print(f"{name}: exit {run.returncode}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", nargs="*", default=None, help="names of COMMANDS to run")
    args = parser.parse_args()
    for name, command in COMMANDS.items():
        if args.only is None or name in args.only:
            dump(name, command, args.out)


if __name__ == "__main__":
    main()
