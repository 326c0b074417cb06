"""Stage correctness without the runner: the example models cut into 2, 3 and 4
stages by contiguous hand-written plans, the stages run in sequence with values fed
by name, compared with the unsplit model (outputs and gradients); checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fxpipe import forked
from fxpipe.codegen import generate, merge_stage_state_dicts, package, split_state_dict
from fxpipe.codegen.stages import PlanError

from ._models import (
    MODELS,
    as_plain,
    grads,
    import_package,
    leaves,
    run_stages,
    traced,
    write_package,
)
from ._plans import contiguous_plan


def _build(tmp_path: Path, name: str, k: int):  # type: ignore[no-untyped-def]
    source, tr = traced(name)
    plan = contiguous_plan(tr.gm.graph, k, model=name)
    package = import_package_from(tmp_path, tr, plan)
    return source, tr, package, package.build_stages(source.model)


def import_package_from(tmp_path, tr, plan):  # type: ignore[no-untyped-def]
    write_package(tmp_path / "pkg", tr, plan)
    return import_package(tmp_path / "pkg")


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("name", MODELS)
def test_stages_match_the_model(tmp_path: Path, name: str, k: int) -> None:
    source, _, package, stages = _build(tmp_path, name, k)
    model = source.model
    assert [type(s).__name__ for s in stages] == [f"Stage{j}" for j in range(k)]

    model.zero_grad(set_to_none=True)
    got = run_stages(package, stages, source.args, source.kwargs)
    loss = source.loss_fn(got, source.target)  # type: ignore[misc]
    loss.backward()
    split_grads = grads(model)

    model.zero_grad(set_to_none=True)
    want = model(*source.args, **source.kwargs)
    source.loss_fn(want, source.target).backward()  # type: ignore[misc]
    model_grads = grads(model)
    model.zero_grad(set_to_none=True)

    for a, b in zip(leaves(got), leaves(want), strict=True):
        torch.testing.assert_close(a, b)
    assert sorted(split_grads) == sorted(model_grads)
    for key, value in model_grads.items():
        torch.testing.assert_close(split_grads[key], value, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", ["mlp", "resnet", "unet"])
def test_float64_is_exact(tmp_path: Path, name: str) -> None:
    source, _, package, stages = _build(tmp_path, name, 3)
    model = source.model.double()
    try:
        args = tuple(a.double() if a.is_floating_point() else a for a in source.args)
        model.zero_grad(set_to_none=True)
        got = run_stages(package, stages, args, {})
        got.square().mean().backward()
        split_grads = grads(model)
        model.zero_grad(set_to_none=True)
        want = model(*args)
        want.square().mean().backward()
        assert torch.equal(got, want)
        for key, value in grads(model).items():
            assert torch.equal(split_grads[key], value), key
    finally:
        model.zero_grad(set_to_none=True)
        model.float()


def _read_state(tr) -> set[str]:  # type: ignore[no-untyped-def]
    """Qualified names of every parameter and buffer the graph reads."""
    names = set()
    for node in tr.gm.graph.nodes:
        if node.op == "get_attr":
            names.add(str(node.target))
        elif node.op == "call_module":
            module = tr.gm.get_submodule(str(node.target))
            names |= {f"{node.target}.{key}" for key in module.state_dict()}
    return names


@pytest.mark.parametrize("name", MODELS)
def test_state_dicts_are_slices_of_the_model(tmp_path: Path, name: str) -> None:
    source, tr, _, stages = _build(tmp_path, name, 3)
    model_state = source.model.state_dict()
    states = [stage.state_dict() for stage in stages]
    union = set().union(*states)
    assert union <= set(model_state)
    assert _read_state(tr) & set(model_state) <= union
    for state in states:
        for key, value in state.items():
            assert value is model_state[key] or value.data_ptr() == model_state[key].data_ptr()

    merged = merge_stage_state_dicts(states)
    assert sorted(merged) == sorted(union)
    for key, value in merged.items():
        assert torch.equal(value, model_state[key])

    # a checkpoint of the model loads into the stages, slice by slice
    checkpoint = {key: value + 1 if value.is_floating_point() else value
                  for key, value in model_state.items()}
    saved = {key: value.clone() for key, value in model_state.items()}
    try:
        for stage, part in zip(stages, split_state_dict(checkpoint, stages), strict=True):
            stage.load_state_dict(part, strict=True)
        for key in union:
            assert torch.equal(source.model.state_dict()[key], checkpoint[key])
    finally:
        source.model.load_state_dict(saved)


def test_tied_head_is_bound_in_both_stages(tmp_path: Path) -> None:
    _, _, _, stages = _build(tmp_path, "gpt", 2)
    first, last = stages[0].state_dict(), stages[-1].state_dict()
    assert "tok_emb.weight" in first and "lm_head.weight" in last
    assert stages[0].get_parameter("tok_emb.weight") is stages[-1].get_parameter("lm_head.weight")
    merged = merge_stage_state_dicts([first, last])
    assert torch.equal(merged["tok_emb.weight"], merged["lm_head.weight"])


def test_merge_rejects_differing_copies() -> None:
    a = {"w": torch.zeros(2), "b": torch.ones(1)}
    b = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="'w' differs between stage 0 and stage 1"):
        merge_stage_state_dicts([a, b])
    assert sorted(merge_stage_state_dicts([a, {"w": torch.zeros(2)}])) == ["b", "w"]


def test_split_state_dict_names_missing_keys(tmp_path: Path) -> None:
    _, _, _, stages = _build(tmp_path, "mlp", 2)
    with pytest.raises(ValueError, match="keys the checkpoint lacks"):
        split_state_dict({}, stages)


def test_plan_that_misses_nodes_is_rejected() -> None:
    from fxpipe.codegen import generate

    _, tr = traced("mlp")
    plan = contiguous_plan(tr.gm.graph, 2)
    broken = type(plan)(**{**plan.__dict__, "stages": plan.stages[:1], "num_stages": 1})
    with pytest.raises(PlanError, match="graph nodes in no stage"):
        generate(tr, broken)


def test_plan_against_the_edges_is_rejected() -> None:
    from fxpipe.codegen import generate

    _, tr = traced("mlp")
    plan = contiguous_plan(tr.gm.graph, 2)
    swapped = tuple(
        type(s)(**{**s.__dict__, "index": 1 - s.index}) for s in reversed(plan.stages)
    )
    with pytest.raises(PlanError, match="must never decrease"):
        generate(tr, type(plan)(**{**plan.__dict__, "stages": swapped}))


def test_output_structure_is_kept() -> None:
    _, tr = traced("hf_t5")
    from fxpipe.codegen import generate

    runner = generate(tr, contiguous_plan(tr.gm.graph, 2))["runner.py"]
    assert '"encoder_last_hidden_state": values[' in runner
    assert as_plain({"a": 1}) == {"a": 1}


def test_the_models_own_modules_are_indexed_where_the_position_is_the_name() -> None:
    """Below a bound path a stage holds the model's own modules, which index as their
    class does; above one it holds the runtime's containers, which index by name."""
    from collections import OrderedDict

    from torch import nn

    from fxpipe.codegen.stages import _indexing

    root = nn.Module()
    root.enc = nn.Module()
    root.enc.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    root.enc.odd = nn.Sequential(OrderedDict([("0", nn.ReLU()), ("2", nn.ReLU())]))
    root.enc.table = nn.ModuleDict({"a-b": nn.ReLU()})
    root.enc.plain = nn.Module()
    root.enc.plain.add_module("0", nn.ReLU())
    whole = _indexing(root, ["enc"])  # type: ignore[arg-type]
    assert whole("enc.layers", "1") == "[1]"
    assert whole("enc.odd", "0") == "[0]"
    assert whole("enc.odd", "2") is None  # odd[1] is child "2": by name instead
    assert whole("enc.table", "a-b") == '["a-b"]'
    assert whole("enc.plain", "0") is None
    assert whole("", "enc") is None  # the stage class itself
    parts = _indexing(root, ["enc.odd.2", "enc.table.a-b"])  # type: ignore[arg-type]
    assert parts("enc.odd", "2") == "[2]"
    assert parts("enc.table", "a-b") == '["a-b"]'
    assert parts("enc.layers", "01") == '["01"]'


def test_stages_written_in_a_forked_child_are_the_ones_written_here(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a big graph the later stages' modules are written in a forked child meanwhile;
    the package is the same, byte for byte, as written in one process."""
    _, tr = traced("llama")
    plan = contiguous_plan(tr.gm.graph, 4)
    with monkeypatch.context() as patched:
        patched.setattr(forked, "_can_fork", lambda: False)
        want = generate(tr, plan)
    forks: list[int] = []
    real_fork = os.fork

    def counted() -> int:
        pid = real_fork()
        if pid:
            forks.append(pid)
        return pid

    monkeypatch.setattr(package, "FORK_MIN_NODES", 1)  # these graphs count as big
    monkeypatch.setattr(forked, "_can_fork", lambda: True)  # a second core or not
    monkeypatch.setattr(os, "fork", counted)
    assert generate(tr, plan) == want
    assert len(forks) == 1
