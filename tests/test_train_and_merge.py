"""The drop-in story end to end: split, train on the stages, merge their checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._cli import fxpipe

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def gpt_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("train")
    done = fxpipe("split", ROOT / "examples" / "gpt.py", "--gpus", "3", "--microbatches", "2",
                  "--schedule", "gpipe", "--out", "pipe", cwd=work)
    assert done.returncode == 0, done.stderr
    return work / "pipe"


def losses(output: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in output.splitlines() if "loss" in line]


def test_training_on_the_stages_gives_the_losses_of_the_model(gpt_package: Path) -> None:
    script = str(ROOT / "examples" / "train_gpt.py")
    plain = run(script, "--steps", "3", "--microbatches", "2", cwd=gpt_package.parent)
    piped = run(script, "--steps", "3", "--pipeline", str(gpt_package), cwd=gpt_package.parent)
    assert plain.returncode == 0 and piped.returncode == 0, plain.stderr + piped.stderr
    assert len(losses(plain.stdout)) == 3
    assert losses(piped.stdout) == pytest.approx(losses(plain.stdout), rel=1e-5)


def test_merge_joins_stage_checkpoints_into_the_model_checkpoint(
    gpt_package: Path, tmp_path: Path
) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    sys.path.insert(0, str(gpt_package.parent))
    package = __import__(gpt_package.name)
    model = gpt.build_model()
    paths = []
    for k, stage in enumerate(package.build_stages(model)):
        paths.append(str(tmp_path / f"stage{k}.pt"))
        torch.save(stage.state_dict(), paths[-1])
    done = fxpipe("merge", *paths, "--out", "model.pt", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "pass --plan DIR to check that every stage is here" in done.stdout
    merged = torch.load(tmp_path / "model.pt", weights_only=True)
    expected = model.state_dict()
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], expected[k]) for k in expected)

    # Checked against the plan: every stage, in order, else nothing is written.
    plan = ("--plan", str(gpt_package))
    checked = fxpipe("merge", *paths, "--out", "checked.pt", *plan, cwd=tmp_path)
    assert checked.returncode == 0 and "--plan" not in checked.stdout, checked.stderr
    assert torch.load(tmp_path / "checked.pt", weights_only=True).keys() == expected.keys()
    for wrong in (paths[:-1], [paths[1], paths[0], *paths[2:]]):
        refused = fxpipe("merge", *wrong, "--out", "wrong.pt", *plan, cwd=tmp_path)
        assert refused.returncode == 2 and "one file per stage, in stage order" in refused.stderr
        assert not (tmp_path / "wrong.pt").exists()

    # A key held by two stages (an export graph's tied weight) must agree, else nothing is written.
    torch.save({"shared.weight": torch.zeros(2)}, tmp_path / "a.pt")
    torch.save({"shared.weight": torch.ones(2)}, tmp_path / "b.pt")
    bad = fxpipe("merge", "a.pt", "b.pt", "--out", "bad.pt", cwd=tmp_path)
    assert bad.returncode == 2 and "differs between stage 0 and stage 1" in bad.stderr
    assert not (tmp_path / "bad.pt").exists()
    missing = fxpipe("merge", "nope.pt", "--out", "x.pt", cwd=tmp_path)
    assert missing.returncode == 2 and "nope.pt: no such file" in missing.stderr


def test_merge_that_cannot_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out a folder, or a write that fails halfway (a full disk): one line, exit 2, and
    the folder as it was: no checkpoint, no scratch file."""
    from fxpipe import cli

    torch.save({"w": torch.zeros(2)}, tmp_path / "stage0.pt")
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert cli.main(["merge", "stage0.pt", "--out", "ckpt"]) == 2
    assert "is a folder, not a checkpoint file" in capsys.readouterr().err
    assert list((tmp_path / "ckpt").iterdir()) == []

    def full_disk(obj: object, path: str) -> None:
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    assert cli.main(["merge", "stage0.pt", "--out", "model.pt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fxpipe: error: cannot write model.pt: No space left on device; choose an "
                   "--out in a folder you can write"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "stage0.pt"]
