"""The generated package's ``__init__.py``: what a user calls, and the torchrun machinery
(distributed.py, torch.distributed.pipelining) imported only when used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ._models import write_package
from .test_golden import _tiny

CALLED = ["DEVICE_OF", "MICROBATCHES", "NUM_GPUS", "PLAN", "PRECISION", "RECOMPUTE",
          "REPLICAS", "SCHEDULE", "WEIGHT_STASHING", "PipelineRunner", "build_schedule",
          "build_stages", "pipeline_stage", "pipeline_stages", "stage_devices", "train_step"]


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden files' package, written whole (its runtime copy with it)."""
    _, traced, plan = _tiny()
    folder = tmp_path_factory.mktemp("pipe")
    write_package(folder, traced, plan)
    return folder


def _run(code: str, folder: Path) -> list[str]:
    """``code`` in a new interpreter, after ``pipe = load_package(folder)``: its lines."""
    prelude = ("import sys\n"
               "from fxpipe.runtime.loading import load_package\n"
               f"pipe = load_package({str(folder)!r})\n"
               "loaded = lambda: 'torch.distributed.pipelining' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                          text=True, check=True)
    return done.stdout.splitlines()


def test_a_single_process_user_never_imports_pipelining(package: Path) -> None:
    lines = _run("print(sorted(pipe.__all__))\n"
                 "runner = pipe.PipelineRunner\n"
                 "print(loaded())\n"
                 "step = pipe.train_step\n"
                 "print(loaded(), step is pipe.distributed.train_step)\n", package)
    assert lines == [str(sorted(CALLED)), "False", "True True"]


def test_plumbing_is_not_exported_and_a_wrong_name_is_an_attribute_error(
        package: Path) -> None:
    lines = _run("print('flatten_inputs' in pipe.__all__, 'build_output' in pipe.__all__)\n"
                 "print(callable(pipe.runner.flatten_inputs))\n"
                 "try:\n    pipe.train_steps\n"
                 "except AttributeError as exc:\n    print(exc, loaded())\n", package)
    assert lines[:2] == ["False False", "True"]
    assert lines[2].endswith("has no attribute 'train_steps' False")
