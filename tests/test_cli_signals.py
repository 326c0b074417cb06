"""SIGINT and SIGTERM sent to a real `fxpipe split` in each phase: one line, exit 130 or
143, no temporary folder left, and the previous --out as it was (or, for a signal held
back during the final renames, the new one complete).

Each run goes through a small launcher that prints a marker on stderr when the phase
begins and then keeps the process in that phase long enough for the signal to land:
the model's forward sleeps while it is traced; the solver gets a search that cannot
finish soon (CP-SAT blocks in C++, where Python's handlers cannot run); a file write
sleeps part-way through the folder; the swap sleeps between its two renames.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODEL = """
import sys
import time

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x):
        if SLEEP_IN_FORWARD:
            print("PHASE tracing", file=sys.stderr, flush=True)
            time.sleep(60)
        return self.b(torch.relu(self.a(x)))


SLEEP_IN_FORWARD = False


def build_model():
    return Net()


def example_inputs():
    return (torch.ones(4, 8),)
"""

LAUNCHER = """
import sys
import time
from pathlib import Path

phase = sys.argv[1]


def announce():
    print(f"PHASE {phase}", file=sys.stderr, flush=True)


if phase == "solving":
    from ortools.sat.python import cp_model

    from fxpipe.partition import ilp

    solve = ilp.StageModel.solve

    def slow_solve(self, **kwargs):
        # A search CP-SAT cannot finish within a minute, run by the real solve().
        hard = cp_model.CpModel()
        xs = [hard.new_int_var(0, 300, f"x{i}") for i in range(120)]
        hard.add_all_different(xs[:100])
        for a, b in zip(xs, xs[1:]):
            hard.add(a != b)
        hard.maximize(sum((i % 7) * x for i, x in enumerate(xs)))
        self.model = hard
        announce()
        return solve(self, **{**kwargs, "time_limit_s": 60})

    ilp.StageModel.solve = slow_solve
elif phase == "writing":
    real = Path.write_text
    calls = []

    def slow_write(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 3:  # part-way through the folder
            announce()
            time.sleep(60)
        return real(self, *args, **kwargs)

    Path.write_text = slow_write
elif phase == "renaming":
    from fxpipe import output

    real_rename = Path.rename

    def slow_rename(self, target):
        done = real_rename(self, target)
        if Path(target).parent.name.endswith(".old"):  # the old folder is set aside
            announce()
            time.sleep(3)
        return done

    Path.rename = slow_rename

from fxpipe.cli import main

sys.exit(main(sys.argv[2:]))
"""


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def interrupt(tmp_path: Path, phase: str, signum: int) -> tuple[int, list[str], float]:
    """Run `fxpipe split` into tmp_path/out, send ``signum`` once ``phase`` begins: the
    exit status, stderr after the marker, and the seconds from the signal to the exit."""
    model = MODEL.replace("SLEEP_IN_FORWARD = False", f"SLEEP_IN_FORWARD = {phase == 'tracing'}")
    (tmp_path / "model.py").write_text(textwrap.dedent(model))
    (tmp_path / "launch.py").write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("FXPIPE_DEBUG", None)
    process = subprocess.Popen(
        [sys.executable, "launch.py", phase, "split", "model.py", "--gpus", "2", "--pp", "2",
         "--out", "out"],
        cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    assert process.stderr is not None
    lines = []
    deadline = time.monotonic() + 240
    for line in process.stderr:
        lines.append(line.rstrip("\n"))
        if line.startswith("PHASE"):
            time.sleep(0.5)  # well inside the phase
            process.send_signal(signum)
            sent = time.monotonic()
            break
        assert time.monotonic() < deadline, lines
    else:
        process.wait()
        pytest.fail(f"the run ended before {phase}: {lines}")
    rest = process.stderr.read().splitlines()
    code = process.wait(timeout=120)
    return code, rest, time.monotonic() - sent


@pytest.fixture
def previous(tmp_path: Path) -> dict[str, bytes]:
    """An earlier run's output, as a folder with fxpipe's marker and a file."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".fxpipe").write_text("written by fxpipe\n")
    (out / "plan.json").write_text("{}\n")
    return snapshot(out)


# Both signals take one path but for CP-SAT, which treats SIGINT specially: both there.
@pytest.mark.parametrize(("phase", "signum"), [
    ("tracing", signal.SIGTERM), ("solving", signal.SIGINT), ("solving", signal.SIGTERM),
    ("writing", signal.SIGINT)])
def test_a_signal_in_any_phase_leaves_the_previous_output(
    tmp_path: Path, previous: dict[str, bytes], phase: str, signum: int
) -> None:
    code, err, seconds = interrupt(tmp_path, phase, signum)
    name = signal.Signals(signum).name
    assert code == 128 + signum, err
    assert err == [f"fxpipe: interrupted by {name}; nothing was written, a previous --out "
                   "is as it was"]
    assert seconds < 30  # the 60-second sleeps and search were cut short
    assert snapshot(tmp_path / "out") == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launch.py", "model.py", "out"]


def test_a_signal_between_the_renames_waits_for_the_new_output(
    tmp_path: Path, previous: dict[str, bytes]
) -> None:
    code, err, _ = interrupt(tmp_path, "renaming", signal.SIGTERM)
    assert code == 143, err
    assert err == ["fxpipe: interrupted by SIGTERM; out had been written in full"]
    written = snapshot(tmp_path / "out")
    assert written != previous and {"plan.json", "runner.py", "stage1.py"} <= written.keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launch.py", "model.py", "out"]
