"""What `fxpipe split` writes: all or nothing, and the same bytes for the same input."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fxpipe import cli

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")
ERRORS = (ROOT / "docs" / "errors.md").read_text()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture
def previous(tmp_path: Path) -> Path:
    """A folder an earlier `fxpipe split` wrote, the thing a failed run must leave alone."""
    out = tmp_path / "out"
    assert cli.main(["split", MLP, "--gpus", "2", "--pp", "2", "--out", str(out)]) == 0
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
    assert cli.main(["split", MLP, "--gpus", "3", "--pp", "3", "--out", str(previous)]) == 2
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
        if previous.parent in self.parents:  # the output folder's, not a scratch file's
            calls.append(self)
        if len(calls) == 3:  # the disk fills up part-way through the folder
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", write_text)
    assert cli.main(["split", MLP, "--gpus", "3", "--pp", "3", "--out", str(previous)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "--out" in err[0]
    assert snapshot(previous) == before
    assert leftovers(previous) == []


def test_ctrl_c_while_writing_leaves_the_previous_folder(
    previous: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = snapshot(previous)
    monkeypatch.setattr(Path, "write_bytes", failing(KeyboardInterrupt()))
    assert cli.main(["split", MLP, "--gpus", "3", "--pp", "3", "--out", str(previous)]) == 130
    assert snapshot(previous) == before
    assert leftovers(previous) == []


def test_a_failed_first_run_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    monkeypatch.setattr("fxpipe.compiler.generate", failing(ValueError("codegen broke")))
    assert cli.main(["split", MLP, "--gpus", "2", "--pp", "2", "--out", str(tmp_path / "out")]) == 2
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
             "--gpus", "3", "--pp", "3", "--out", str(out)],
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


def one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fxpipe: error: "), err
    return err[0].removeprefix("fxpipe: error: ")


# Each --out the file system will not take, as the command prints it (docs/errors.md's error
# table lists them) and before any slow work: tracing fails the test if it runs.
OUT_REFUSED = {
    "--out under a file": (
        "notes/out",
        "could not write notes/out: notes is a file, not a folder; choose an --out outside "
        "it (nothing was changed)"),
    "--out a link to a folder that does not exist": (
        "latest",
        "--out latest is a symbolic link to missing/out, whose folder missing does not "
        "exist; point the link at a folder that exists or choose another --out (nothing was "
        "changed)"),
    "--out a link that leads back to itself": (
        "loop",
        "--out loop is a symbolic link that leads back to itself; point it at a folder or "
        "choose another --out (nothing was changed)"),
    # /sys refuses new files, to root too
    "--out where nothing can be written": (
        "/sys/fxpipe-out",
        "could not write /sys/fxpipe-out: Permission denied in /sys; choose an --out in a "
        "folder you can write (nothing was changed)"),
}


@pytest.mark.parametrize("case", list(OUT_REFUSED))
def test_an_out_that_cannot_be_written_is_refused_first_with_its_cause(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "notes").write_text("mine")
    (tmp_path / "latest").symlink_to(Path("missing") / "out")
    (tmp_path / "loop").symlink_to("loop")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("fxpipe.frontend.trace", failing(AssertionError("traced first")))
    before = sorted(p.name for p in tmp_path.iterdir())
    out, message = OUT_REFUSED[case]
    assert cli.main(["split", MLP, "--gpus", "2", "--pp", "2", "--out", out]) == 2
    assert one_error(capsys) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert f"| {case} | `{message}` |" in ERRORS, f"docs/errors.md lacks the row for {case}"


@pytest.mark.parametrize("where", ["probe", "staging"])
def test_a_read_only_file_system_names_itself_and_the_fix(
    previous: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    where: str,
) -> None:
    """No read-only mount can be made here (root writes through chmod), so the file system
    answers EROFS through tempfile: the check before the work makes a file, the write a
    folder."""
    before = snapshot(previous)

    name = "mkstemp" if where == "probe" else "mkdtemp"
    real = getattr(tempfile, name)

    def read_only(*args: object, **kwargs: object) -> object:
        folder = kwargs.get("dir", args[2] if len(args) > 2 else None)  # (suffix, prefix, dir)
        if folder is None or Path(str(folder)) != previous.parent:  # a scratch folder
            return real(*args, **kwargs)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(previous.parent / "x"))

    monkeypatch.setattr(tempfile, name, read_only)
    assert cli.main(["split", MLP, "--gpus", "3", "--pp", "3", "--out", str(previous)]) == 2
    assert one_error(capsys) == (
        f"could not write {previous}: Read-only file system in {previous.parent}; choose an "
        "--out on a writable file system (nothing was changed)")
    assert snapshot(previous) == before
    assert leftovers(previous) == []


def test_a_link_to_an_fxpipe_folder_is_followed_and_kept(
    previous: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacing the link would leave the folder it names stale and the link gone: the
    folder is written, all or nothing as ever, and the link still names it."""
    link = previous.parent / "latest"
    link.symlink_to(previous.name)
    monkeypatch.chdir(previous.parent)
    capsys.readouterr()
    assert cli.main(["split", MLP, "--gpus", "3", "--pp", "3", "--out", "latest"]) == 0
    assert "wrote latest/, the folder it links to, out/ (" in capsys.readouterr().out
    assert link.is_symlink() and link.resolve() == previous.resolve()
    assert (previous / "stage2.py").exists()
    assert sorted(p.name for p in previous.parent.iterdir()) == ["latest", "out"]
    # a link to a folder not there yet: the folder is made where the link points
    (previous.parent / "next").symlink_to("runs/seven")
    (previous.parent / "runs").mkdir()
    assert cli.main(["split", MLP, "--gpus", "2", "--pp", "2", "--out", "next"]) == 0
    assert (previous.parent / "runs" / "seven" / "plan.json").exists()
    assert (previous.parent / "next").is_symlink()


def test_a_long_name_is_written_and_a_too_long_one_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hidden folders beside --out take a cut of its name: a name of 250 bytes, which
    the file system takes, is written; one of 300 is refused before any work."""
    monkeypatch.chdir(tmp_path)
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    fits = "a" * (longest - 5)
    code = cli.main(["split", MLP, "--gpus", "2", "--pp", "2", "--out", fits])
    assert code == 0, capsys.readouterr()
    assert [p.name for p in tmp_path.iterdir()] == [fits]
    capsys.readouterr()
    too_long = "b" * (longest + 45)
    monkeypatch.setattr("fxpipe.frontend.trace", failing(AssertionError("traced first")))
    assert cli.main(["split", MLP, "--gpus", "2", "--pp", "2", "--out", f"{too_long}/pipe"]) == 2
    assert one_error(capsys) == (
        f"could not write {too_long}/pipe: the name {'b' * 24}... is {longest + 45} bytes "
        f"long, more than the {longest} a name may have there; choose a shorter --out "
        "(nothing was changed)")
    assert [p.name for p in tmp_path.iterdir()] == [fits]
