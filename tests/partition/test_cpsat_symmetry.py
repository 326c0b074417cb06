"""CP-SAT's symmetry detection is off in fxpipe's searches: on OR-Tools 9.15 it proved this
stage program (the coarse graph of Llama-3-70B at 8192 tokens, ``--gpus 64 --pp 4 --tp 8``,
exported by ``CpModel.export_to_file``) INFEASIBLE, though it has a solution, and with
interleaved workers aborted the process. Each solve runs in a child process, so that an
abort fails the test rather than the test run."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "data" / "symmetry_infeasible.pbtxt.gz"

SOLVE = """
import gzip, sys
from ortools.sat.python import cp_model
from fxpipe.partition.ilp_search import run_search

model = cp_model.CpModel()
model.proto.parse_text_format(gzip.open(sys.argv[1], "rt").read())
search = run_search(model, work_limit=2.5, time_limit_s=120, workers=2, log=False)
print(search.status, int(search.objective))
"""


def test_the_program_symmetry_broke_is_solved_to_its_optimum() -> None:
    """fxpipe's own search parameters (two interleaved workers, deterministic time): the
    optimum the program has (found with symmetry detection off, and without presolve)."""
    done = subprocess.run([sys.executable, "-c", SOLVE, str(MODEL)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["OPTIMAL", "4365500"]


def test_the_program_is_the_one_exported() -> None:
    """The file is a whole CP-SAT program with its hint (a stand-in file would pass the
    test above vacuously)."""
    with gzip.open(MODEL, "rt") as file:
        text = file.read()
    assert text.count("variables {") > 100 and "solution_hint" in text and "objective" in text
