"""Before anything is written, every generated stage is built against the model
(``fxpipe.codegen.build_check``): a package that cannot be built is one line and no
folder, never a success that fails in the user's training script."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fxpipe import cli, compiler
from fxpipe.codegen import generate
from fxpipe.codegen.build_check import PackageBuildError, check_builds
from fxpipe.frontend import trace

from ._plans import contiguous_plan

MODEL_FILE = '''
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())


def example_inputs():
    return (torch.randn(4, 8),)
'''


def test_a_stage_that_does_not_bind_is_named() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())
    traced = trace(model, (torch.randn(4, 8),))
    files = generate(traced, contiguous_plan(traced.gm.graph, 2))
    check_builds(files, model)  # the model traced: every stage builds
    shorter = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # no child "2"
    with pytest.raises(PackageBuildError, match=r"^stage1\.py does not build against the "
                       r"model \(AttributeError: .*; nothing was written$"):
        check_builds(files, shorter)
    broken = {**files, "stage0.py": files["stage0.py"] + "\ndef (:\n"}
    with pytest.raises(PackageBuildError, match=r"^the generated package does not import "
                       r"\(SyntaxError: "):
        check_builds(broken, model)


def test_split_writes_nothing_when_a_stage_does_not_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fault of the code generator (here: a stage made to bind a name the model lacks)
    ends the split with one line, and --out is never created."""
    (tmp_path / "model.py").write_text(MODEL_FILE, encoding="utf-8")

    def faulty(*args: object, **kwargs: object) -> dict[str, str]:
        files = generate(*args, **kwargs)  # type: ignore[arg-type]
        files["stage1.py"] = files["stage1.py"].replace('bind(self, model, "2")',
                                                        'bind(self, model, "_missing")')
        return files

    monkeypatch.setattr(compiler, "generate", faulty)
    out = tmp_path / "out"
    code = cli.main(["split", str(tmp_path / "model.py"), "--gpus", "2", "--pp", "2", "--out",
                     str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_INTERNAL_ERROR and len(lines) == 1, lines
    assert "stage1.py does not build against the model (AttributeError" in lines[0]
    assert not out.exists()
