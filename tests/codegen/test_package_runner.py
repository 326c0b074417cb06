"""Transparency through the generated package: build_stages + PipelineRunner give
the unsplit model's outputs and gradients, for both schedules, with and without
recompute in full or selectively (the runtime's own unit tests live in tests/runtime)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._models import (
    MODELS,
    assert_runner_matches,
    import_package,
    mini_batch,
    traced,
    write_package,
)
from ._plans import contiguous_plan

# "selective:64:32": keeping only the matmuls doing more than 64 FLOPs per element (or 64,
# at most 32 wide) and running the others again
SETTINGS = [("gpipe", False), ("1f1b", True), ("1f1b", "selective"), ("1f1b", False),
            ("gpipe", True), ("gpipe", "selective:64:32")]
# the symbolic models take every setting; the exported ones three, to keep the suite short
CASES = [
    (name, schedule, recompute)
    for name in MODELS
    for schedule, recompute in (SETTINGS[:3] if name.startswith("hf_") else SETTINGS)
]


@pytest.mark.parametrize(("name", "schedule", "recompute"), CASES)
def test_runner_matches_the_model(
    tmp_path: Path, name: str, schedule: str, recompute: bool | str
) -> None:
    source, tr = traced(name)
    k = 3
    plan = contiguous_plan(tr.gm.graph, k, schedule=schedule, microbatches=2,
                           recompute=(recompute,) * k, model=name)
    write_package(tmp_path / "pkg", tr, plan)
    package = import_package(tmp_path / "pkg")
    model = source.model
    runner = package.PipelineRunner(package.build_stages(model))
    assert runner.schedule == [tuple(t) for t in package.SCHEDULE]

    assert_runner_matches(runner, model, mini_batch(source.args), mini_batch(source.kwargs),
                          mini_batch(source.target), source.loss_fn)


def test_load_package_names_a_folder_without_one(tmp_path: Path) -> None:
    from fxpipe.codegen import load_package

    with pytest.raises(ValueError, match=rf"^{tmp_path}: no generated package here \(no "
                       rf"__init__.py\); run fxpipe split MODEL --out {tmp_path} first$"):
        load_package(tmp_path)
    _, graph = traced("mlp")
    write_package(tmp_path / "pkg", graph, contiguous_plan(graph.gm.graph, 2))
    first, second = load_package(tmp_path / "pkg"), load_package(tmp_path / "pkg")
    assert first is not second and first.__name__ != second.__name__  # never collide
    assert first.PLAN == second.PLAN and first.PLAN["num_stages"] == 2
