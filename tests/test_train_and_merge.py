"""The drop-in story end to end: split, train on the stages, merge their checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def gpt_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("train")
    done = run("-m", "fxpipe.cli", "split", str(ROOT / "examples" / "gpt.py"), "--gpus", "3",
               "--microbatches", "2", "--schedule", "gpipe", "--out", "pipe", cwd=work)
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
    done = run("-m", "fxpipe.cli", "merge", *paths, "--out", "model.pt", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    merged = torch.load(tmp_path / "model.pt", weights_only=True)
    expected = model.state_dict()
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], expected[k]) for k in expected)

    # A key held by two stages (an export graph's tied weight) must agree, else nothing is written.
    torch.save({"shared.weight": torch.zeros(2)}, tmp_path / "a.pt")
    torch.save({"shared.weight": torch.ones(2)}, tmp_path / "b.pt")
    bad = run("-m", "fxpipe.cli", "merge", "a.pt", "b.pt", "--out", "bad.pt", cwd=tmp_path)
    assert bad.returncode == 2 and "differs between stage 0 and stage 1" in bad.stderr
    assert not (tmp_path / "bad.pt").exists()
    missing = run("-m", "fxpipe.cli", "merge", "nope.pt", "--out", "x.pt", cwd=tmp_path)
    assert missing.returncode == 2 and "nope.pt: no such file" in missing.stderr
