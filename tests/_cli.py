"""The ``fxpipe`` command, run in this process or as a new one, for tests of what it prints.

In this process, ``cli.main`` gets the argv and the folder a shell would give it, and what
it writes to stdout and stderr is returned, warnings included (printed as a new
interpreter prints them), as a subprocess run returns it. A new interpreter spends 3-5 s
of a 2-core machine importing torch, so only the tests that need a real process (exit
codes the console script sets, signals, hash seeds, stream separation) start one.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

from fxpipe import cli

__all__ = ["Ran", "fxpipe", "fxpipe_process"]


@dataclass(frozen=True)
class Ran:
    """What a run of the command left: its exit status and its two streams."""

    returncode: int
    stdout: str
    stderr: str


def fxpipe(*args: str | Path, cwd: Path) -> Ran:
    """``fxpipe ARGS`` run in ``cwd``, in this process."""
    out, err = io.StringIO(), io.StringIO()
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        with redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = _printed
            code = cli.main([str(arg) for arg in args])
    finally:
        os.chdir(previous)
    return Ran(code, out.getvalue(), err.getvalue())


def fxpipe_process(*args: str | Path, cwd: Path) -> Ran:
    """``fxpipe ARGS`` run in ``cwd`` by a new interpreter."""
    done = subprocess.run([sys.executable, "-m", "fxpipe.cli", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    return Ran(done.returncode, done.stdout, done.stderr)


def _printed(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: object = None, line: str | None = None) -> None:
    """A warning as the interpreter prints it, on the stderr of the run."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
