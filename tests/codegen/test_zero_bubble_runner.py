"""Transparency of the zero-bubble schedules through the generated package: each backward
run as I (input gradient) then, later, W (weight gradient) gives the unsplit model's
outputs, loss and every gradient: GPT with its tied embedding and LM head, Llama, and the
U-Net whose skips cross stages. ZB-H1 on K = 4 stages; ZB-V and DualPipeV on 2 GPUs with
4 stage modules in a V (GPU 0 runs stages 0 and 3, so the GPT embedding and its tied
head share a GPU, GPU 1 stages 1 and 2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from fxpipe.schedules import one_f_one_b, zb1p

from ._models import assert_runner_matches, import_package, mini_batch, traced, write_package
from ._plans import contiguous_plan

CASES = [(name, schedule) for name in ("gpt", "llama", "unet")
         for schedule in ("zb1p", "zbv", "dualpipev")]


@pytest.mark.parametrize(("name", "schedule"), CASES)
def test_split_backward_matches_the_model(tmp_path: Path, name: str, schedule: str) -> None:
    source, tr = traced(name)
    k, m = 4, 4
    plan = contiguous_plan(tr.gm.graph, k, schedule=schedule, microbatches=m, model=name)
    if schedule != "zb1p":
        plan = dataclasses.replace(plan, virtual_stages=2)
        assert [plan.devices_of(j)[0] for j in range(k)] == [0, 1, 1, 0]
    write_package(tmp_path / "pkg", tr, plan)
    package = import_package(tmp_path / "pkg")
    kinds = {kind for tick in package.SCHEDULE for _j, kind, _m in tick}
    assert kinds == {"F", "I", "W"}, "every backward split"
    model = source.model.double()  # the session's shared model: made float again below
    try:
        runner = package.PipelineRunner(package.build_stages(model))
        assert_runner_matches(runner, model, _as_double(mini_batch(source.args)),
                              _as_double(mini_batch(source.kwargs)),
                              _as_double(mini_batch(source.target)), source.loss_fn)
    finally:
        model.float()


def _as_double(value: Any) -> Any:
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, value)


def test_another_table_keeps_the_v_placement(tmp_path: Path) -> None:
    """The single-process runner takes a table, not a kind: the table only orders the
    actions, and each stage runs where the plan put it (DEVICE_OF, the V), so a ZB-V plan
    run on a 1F1B table or a ZB-H1 table over its 4 stage modules stays transparent;
    there is no placement to refuse, unlike torchrun's build_schedule."""
    source, tr = traced("gpt")
    plan = contiguous_plan(tr.gm.graph, 4, schedule="zbv", microbatches=4, model="gpt")
    write_package(tmp_path / "pkg", tr, dataclasses.replace(plan, virtual_stages=2))
    package = import_package(tmp_path / "pkg")
    assert package.DEVICE_OF == (0, 1, 1, 0)
    model = source.model.double()
    try:
        for table in (one_f_one_b(4, 4), zb1p(4, 4)):
            runner = package.PipelineRunner(package.build_stages(model), schedule=table)
            assert runner.schedule == [tuple(tick) for tick in table]
            assert_runner_matches(runner, model, _as_double(mini_batch(source.args)),
                                  _as_double(mini_batch(source.kwargs)),
                                  _as_double(mini_batch(source.target)), source.loss_fn)
    finally:
        model.float()
