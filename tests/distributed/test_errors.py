"""The distributed entry's one-line errors, and the adapters' routing in one process
(skips passed through a middle stage, tied copies, baked constants, example metadata)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ._helpers import EXAMPLES, contiguous_plan, import_package, load, write_package

_names = itertools.count()


def _package(tmp_path: Path, name: str, k: int, schedule: str = "gpipe",
             replicas: tuple[int, ...] | None = None, virtual_stages: int = 1) -> tuple:
    source, traced = load(str(EXAMPLES / f"{name}.py"))
    plan = contiguous_plan(traced.gm.graph, k, schedule=schedule, replicas=replicas,
                           virtual_stages=virtual_stages)
    write_package(tmp_path / "pkg", traced, plan)
    return source, import_package(tmp_path / "pkg", f"fxpipe_dist_err_{next(_names)}")


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return _package(tmp_path_factory.mktemp("gpt"), "gpt", 2, "1f1b")


def test_world_size_must_equal_the_number_of_stages(gpt: tuple) -> None:
    source, package = gpt
    with pytest.raises(ValueError, match=r"world size \(3\) must equal the number of pipeline "
                       r"stages \(2\): launch with torchrun --nproc-per-node 2"):
        package.pipeline_stage(source.model, 0, 3, "cpu", *source.args)


def test_replicated_plan_needs_every_gpu_and_even_chunks(tmp_path: Path) -> None:
    source, package = _package(tmp_path, "gpt", 2, "1f1b", replicas=(2, 2))
    pipeline = package.distributed.PIPELINE
    assert pipeline.lanes == 2 and pipeline.uniform and pipeline.unsupported is None
    with pytest.raises(ValueError, match=r"world size \(2\) must equal the number of GPUs of "
                       r"the plan \(2-2\): launch with torchrun --nproc-per-node 4"):
        package.pipeline_stage(source.model, 0, 2, "cpu", *source.args)
    assert [pipeline.position(rank) for rank in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # lane 1 of M = 2 micro-batches of 4 rows: rows 2-3 of the first and 6-7 of the second
    rows = torch.arange(8)
    share = pipeline.lane_share(rows, 1, microbatches=2, what="the mini-batch")
    assert share.tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="the mini-batch has 6 rows along dim 0, which do not "
                       "split into 2 micro-batches of 2 equal replica chunks; use a batch size "
                       "that is a multiple of 4"):
        pipeline.lane_share(torch.zeros(6, 3), 0, microbatches=2, what="the mini-batch")


def test_interleaved_plan_gives_each_rank_its_stages(tmp_path: Path) -> None:
    source, package = _package(tmp_path, "gpt", 6, "interleaved", virtual_stages=3)
    pipeline = package.distributed.PIPELINE
    assert pipeline.unsupported is None and pipeline.num_ranks == 2
    assert [pipeline.stages_of(rank) for rank in range(2)] == [(0, 2, 4), (1, 3, 5)]
    assert [pipeline.ranks_of(j) for j in range(6)] == [(0,), (1,), (0,), (1,), (0,), (1,)]
    with pytest.raises(ValueError, match=r"world size \(6\) must equal the number of GPUs of "
                       r"the plan \(2, each running 3 of its 6 stages\): launch with torchrun "
                       r"--nproc-per-node 2"):
        package.pipeline_stages(source.model, 0, 6, "cpu", *source.args)
    with pytest.raises(ValueError, match="this plan is interleaved: every rank runs 3 stages; "
                       "call pipeline_stages for the list of them"):
        package.pipeline_stage(source.model, 0, 2, "cpu", *source.args)
    # the check comes before any stage is needed
    with pytest.raises(ValueError, match=r"an interleaved plan runs interleaved 1F1B with a "
                       r"multiple of 2 micro-batches \(got interleaved, M = 3\)"):
        package.build_schedule([None] * 3, None, microbatches=3)
    with pytest.raises(ValueError, match=r"^this plan was split for interleaved, stage j on "
                       r"rank \[0, 1, 0, 1, 0, 1\]\[j\]; 1f1b runs one stage per rank \(6 "
                       r"stages on 2 ranks\): split again with --schedule 1f1b$"):
        package.build_schedule([None] * 3, None, schedule="1f1b")


def test_pipedream_plan_is_refused_under_torchrun(tmp_path: Path) -> None:
    source, package = _package(tmp_path, "gpt", 2, "pipedream")
    with pytest.raises(ValueError, match=r"this plan's pipedream stages \(weight stashing\) run "
                       r"in runner.PipelineRunner \(one process\) only"):
        package.pipeline_stages(source.model, 0, 2, "cpu", *source.args)


def test_uneven_replicas_need_rows_that_split_and_the_planned_table(tmp_path: Path) -> None:
    source, package = _package(tmp_path, "gpt", 2, "1f1b", replicas=(1, 3))
    pipeline = package.distributed.PIPELINE
    assert not pipeline.uniform and pipeline.unsupported is None
    assert [pipeline.position(rank) for rank in range(4)] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    # the example micro-batch has 2 rows: not three equal chunks
    with pytest.raises(ValueError, match=r"the example micro-batch has 2 rows along dim 0, "
                       r"which do not split into equal chunks for every stage's replicas "
                       r"\(1-3\); use a micro-batch size that is a multiple of each"):
        package.pipeline_stage(source.model, 1, 4, "cpu", *source.args)


def test_not_under_torchrun(gpt: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    _, package = gpt
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="not launched under torchrun"):
        package.distributed.init_distributed()


def test_launch_script_without_torchrun_says_so(tmp_path: Path) -> None:
    _, traced = load(str(EXAMPLES / "mlp.py"))
    write_package(tmp_path / "pkg", traced, contiguous_plan(traced.gm.graph, 2, schedule="1f1b"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(tmp_path / "pkg" / "train_torchrun.py"), "--model",
         str(EXAMPLES / "mlp.py")], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not launched under torchrun (RANK and WORLD_SIZE unset)" in lines[0]


def test_checkpoint_missing_keys_are_named(gpt: tuple) -> None:
    source, package = gpt
    state = source.model.state_dict()
    del state["lm_head.weight"], state["ln_f.bias"], state["blocks.0.ln_1.weight"]
    with package.distributed.parameters_on_meta():
        model = __import__("importlib").import_module("examples.gpt").build_model()
    assert model.tok_emb.weight.is_meta and model.lm_head.weight is model.tok_emb.weight
    assert not model.blocks[0].attn.causal_mask.is_meta  # buffers stay real
    # stage 1 holds lm_head and ln_f: both missing keys are named, stage 0's is not
    with pytest.raises(ValueError, match=r"the checkpoint lacks 2 keys stage 1 needs: "
                       r"(lm_head.weight, ln_f.bias|ln_f.bias, lm_head.weight)$"):
        package.distributed.stage_module(model, 1, "cpu", *source.args, checkpoint=state)


def _chain(package, model: nn.Module, k: int, args: tuple, kwargs: dict, **options) -> tuple:
    """All K adapters in one process, fed as torch would feed them."""
    make = package.distributed.stage_module
    built = [make(model, j, "cpu", *args, **options, **kwargs) for j in range(k)]
    values = package.runner.flatten_inputs(*args, **kwargs)
    flat = tuple(values[name] for name in built[0][0].receives)
    for adapter, inputs, outputs in built:
        assert [t.shape for t in flat] == [t.shape for t in inputs]
        assert [t.requires_grad for t in flat] == [t.requires_grad for t in inputs]
        flat = adapter(*flat)
        if adapter.sends is not None:
            assert [t.shape for t in flat] == [t.shape for t in outputs]
            assert [t.requires_grad for t in flat] == [t.requires_grad for t in outputs]
    return flat, [adapter for adapter, _, _ in built]


def test_skips_pass_through_the_middle_stage(tmp_path: Path) -> None:
    source, package = _package(tmp_path, "unet", 3)
    wires = package.distributed.WIRES
    passed = set(wires[1]) & set(wires[2])
    assert passed, wires  # a skip from stage 0 read by stage 2 rides through stage 1
    model = source.model
    out, adapters = _chain(package, model, 3, source.args, source.kwargs,
                           checkpoint=model.state_dict())
    want = model(*source.args)
    torch.testing.assert_close(out, want)
    source.loss_fn(out, source.target).backward()
    model.zero_grad(set_to_none=True)
    source.loss_fn(want, source.target).backward()
    for adapter in adapters:
        for name, param in adapter.stage.named_parameters():
            torch.testing.assert_close(param.grad, model.get_parameter(name).grad)
    model.zero_grad(set_to_none=True)


def test_gpt_metadata_and_tied_table(gpt: tuple) -> None:
    source, package = gpt
    assert package.distributed.TIED == ({0: "tok_emb.weight", 1: "lm_head.weight"},)
    _, inputs0, outputs0 = package.distributed.stage_module(source.model, 0, "cpu", *source.args)
    assert [t.requires_grad for t in inputs0] == [False]  # token ids
    assert all(t.requires_grad and t.dtype == torch.float32 for t in outputs0)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * scale)


def test_non_tensor_values_are_baked_constants(tmp_path: Path) -> None:
    from fxpipe.frontend import trace

    torch.manual_seed(0)
    model = _Scaled()
    x = torch.randn(3, 4)
    traced = trace(model, (x,))
    write_package(tmp_path / "pkg", traced, contiguous_plan(traced.gm.graph, 2, schedule="1f1b"))
    package = import_package(tmp_path / "pkg", f"fxpipe_dist_err_{next(_names)}")
    out, adapters = _chain(package, model, 2, (x,), {})
    assert adapters[0].constants == {"scale": 2.0} and "scale" not in adapters[0].receives
    torch.testing.assert_close(out, model(x))
