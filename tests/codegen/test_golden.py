"""Golden files: a tiny MLP cut into 2 stages by a hand-written plan.

Regenerate with ``FXPIPE_UPDATE_GOLDEN=1 pytest tests/codegen/test_golden.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from fxpipe.codegen import generate
from fxpipe.frontend import Traced, trace
from fxpipe.plan import Plan

from ._models import MODELS, import_package, ruff, traced, write_package
from ._plans import contiguous_plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "mlp_2stage"


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        h = self.norm(h + torch.relu(self.fc2(h))) * scale
        return self.head(h)


def _tiny() -> tuple[TinyMLP, Traced, Plan]:
    torch.manual_seed(0)
    model = TinyMLP()
    traced = trace(model, (torch.randn(3, 4),))
    plan = contiguous_plan(traced.gm.graph, 2, schedule="1f1b", microbatches=3,
                           recompute=(False, True), model="TinyMLP")
    return model, traced, plan


def _golden_view(traced: Traced, plan: Plan) -> dict[str, str]:
    """The generated files without the runtime copy (fxpipe/runtime's own text, with
    its own tests; ``test_runtime_copy_is_byte_identical`` checks the copy)."""
    return {name: text for name, text in generate(traced, plan).items()
            if not name.startswith("runtime/")}


def test_matches_golden_files() -> None:
    _, traced, plan = _tiny()
    files = _golden_view(traced, plan)
    if os.environ.get("FXPIPE_UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for old in GOLDEN.iterdir():
            old.unlink()
        for name, text in files.items():
            (GOLDEN / name).write_text(text, encoding="utf-8")
    on_disk = {p.name: p.read_text(encoding="utf-8") for p in sorted(GOLDEN.iterdir())}
    assert sorted(on_disk) == sorted(files), "regenerate with FXPIPE_UPDATE_GOLDEN=1"
    for name, text in files.items():
        assert text == on_disk[name], f"{name} differs from {GOLDEN / name}"


def test_byte_identical_run_to_run() -> None:
    _, traced, plan = _tiny()
    _, traced_again, plan_again = _tiny()
    assert generate(traced, plan) == generate(traced, plan)
    assert generate(traced, plan) == generate(traced_again, plan_again)


def test_runtime_copy_is_byte_identical() -> None:
    """The package carries every module of fxpipe/runtime unchanged, and nothing else
    under runtime/."""
    import fxpipe.runtime

    _, traced, plan = _tiny()
    files = generate(traced, plan)
    source = Path(fxpipe.runtime.__file__).parent
    copied = {name.removeprefix("runtime/"): text for name, text in files.items()
              if name.startswith("runtime/")}
    assert sorted(copied) == sorted(p.name for p in source.glob("*.py"))
    for name, text in copied.items():
        assert text.encode("utf-8") == (source / name).read_bytes(), name


def test_generated_files_are_small() -> None:
    """Generate data and stage classes: what is not a stage class or the runtime copy
    is the plan's data and a thin binding, not the runtime spliced in."""
    _, traced, plan = _tiny()
    files = generate(traced, plan)
    for name in ("runner.py", "distributed.py", "__init__.py", "train_torchrun.py"):
        assert files[name].count("\n") < 150, name
    assert "class PipelineRunner(runtime.PipelineRunner)" in files["runner.py"]
    assert "def _bind" not in files["stage0.py"]


def test_generated_files_pass_ruff(tmp_path: Path) -> None:
    _, tiny, plan = _tiny()
    write_package(tmp_path / "tiny", tiny, plan)
    assert ruff(tmp_path / "tiny") == ""
    assert ruff(GOLDEN) == ""  # the .py files; the runner header is a fragment


def test_example_packages_pass_ruff(tmp_path: Path) -> None:
    for name in MODELS:
        _, graph = traced(name)
        write_package(tmp_path / name, graph, contiguous_plan(graph.gm.graph, 3, model=name))
    assert ruff(tmp_path) == ""


@pytest.mark.parametrize("name", ["stage0", "stage1", "runner", "distributed"])
def test_files_import_within_the_package(tmp_path: Path, name: str) -> None:
    """Each generated module imports with only its package's runtime copy."""
    _, traced, plan = _tiny()
    write_package(tmp_path / "tiny", traced, plan)
    package = import_package(tmp_path / "tiny")
    module = getattr(package, name, None) or __import__(f"{package.__name__}.{name}",
                                                        fromlist=["_"])
    if name.startswith("stage"):
        assert isinstance(getattr(module, f"Stage{name[5]}").INPUTS, tuple)


def test_package_runs_the_tiny_mlp(tmp_path: Path) -> None:
    model, traced, plan = _tiny()
    write_package(tmp_path / "tiny", traced, plan)
    package = import_package(tmp_path / "tiny")
    stages = package.build_stages(model)
    assert package.PLAN["num_stages"] == 2 and package.SCHEDULE
    assert package.runner.RECOMPUTE == ("none", "full")
    assert stages[0].INPUTS == ("x",)
    x = torch.randn(9, 4)
    runner = package.PipelineRunner(stages)
    torch.testing.assert_close(runner.forward(x), model(x))
    # under torchrun too, the plan's stage 1 recomputes and stage 0 does not
    adapters = [package.distributed.stage_module(model, k, "cpu", x)[0] for k in range(2)]
    assert [adapter.recompute for adapter in adapters] == ["none", "full"]
    # the default baked into flatten_inputs is the forward's own
    assert package.runner.flatten_inputs(x) == {"x": x, "scale": 2.0}


def test_shape_comments_where_shapes_are_known(tmp_path: Path) -> None:
    from fxpipe.passes.shapes import annotate_shapes

    _, traced, plan = _tiny()
    annotate_shapes(traced.gm, *traced.flat_inputs)
    stage0 = generate(traced, plan)["stage0.py"]
    assert "fc1 = self.fc1(x)  # float32[3, 8]" in stage0
    write_package(tmp_path / "tiny", traced, plan)
    assert ruff(tmp_path / "tiny") == ""
