"""What `fxpipe split` writes: all or nothing, and the same bytes for the same input."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxpipe import cli

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture
def previous(tmp_path: Path) -> Path:
    """A folder an earlier `fxpipe split` wrote, the thing a failed run must leave alone."""
    out = tmp_path / "out"
    assert cli.main(["split", MLP, "--gpus", "2", "--out", str(out)]) == 0
    return out


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name != folder.name)


def failing(exc: BaseException):
    def raise_it(*args: object, **kwargs: object) -> None:
        raise exc
    return raise_it


@pytest.mark.parametrize(
    "where",
    ["fxpipe.frontend.trace", "fxpipe.compiler.partition", "fxpipe.compiler.generate"],
)
def test_a_failing_step_leaves_the_previous_folder_untouched(
    previous: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    where: str,
) -> None:
    before = snapshot(previous)
    module, _, name = where.rpartition(".")
    monkeypatch.setattr(f"{module}.{name}", failing(ValueError(f"{name} broke")))
    assert cli.main(["split", MLP, "--gpus", "3", "--out", str(previous)]) == 2
    assert f"{name} broke" in capsys.readouterr().err
    assert snapshot(previous) == before
    assert leftovers(previous) == []


def test_a_full_disk_is_one_line_and_changes_nothing(
    previous: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(previous)
    real_write = Path.write_text
    calls = []

    def write_text(self: Path, *args: object, **kwargs: object) -> int:
        calls.append(self)
        if len(calls) == 3:  # the disk fills up part-way through the folder
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", write_text)
    assert cli.main(["split", MLP, "--gpus", "3", "--out", str(previous)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "--out" in err[0]
    assert snapshot(previous) == before
    assert leftovers(previous) == []


def test_ctrl_c_while_writing_leaves_the_previous_folder(
    previous: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = snapshot(previous)
    monkeypatch.setattr(Path, "write_bytes", failing(KeyboardInterrupt()))
    assert cli.main(["split", MLP, "--gpus", "3", "--out", str(previous)]) == 130
    assert snapshot(previous) == before
    assert leftovers(previous) == []


def test_a_failed_first_run_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    monkeypatch.setattr("fxpipe.compiler.generate", failing(ValueError("codegen broke")))
    assert cli.main(["split", MLP, "--gpus", "2", "--out", str(tmp_path / "out")]) == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("example", ["gpt.py", "hf_gpt2.py"])  # symbolic_trace and export
def test_same_model_and_flags_give_identical_files_across_hash_seeds(
    tmp_path: Path, example: str
) -> None:
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"out{seed}"
        done = subprocess.run(
            [sys.executable, "-m", "fxpipe.cli", "split", str(ROOT / "examples" / example),
             "--gpus", "3", "--out", str(out)],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert done.returncode == 0, done.stderr
        files = snapshot(out)
        assert b"solver_wall_s" in files.pop("timing.json")  # the one file that varies
        outputs.append(files)
    assert outputs[0].keys() == outputs[1].keys()
    assert {"plan.json", "report.md", "runner.py", "stage0.py"} <= outputs[0].keys()
    different = [name for name in outputs[0] if outputs[0][name] != outputs[1][name]]
    assert different == []
