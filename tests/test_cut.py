"""The stage cut, ``fxpipe.cut``: computed once, recorded in the plan by ``build_plan``,
and the same one the generated stages receive and return."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from codegen._models import import_package, run_stages, write_package
from codegen._plans import contiguous_plan

from fxpipe import cli
from fxpipe.cut import cut_stages
from fxpipe.frontend import trace

ROOT = Path(__file__).resolve().parents[1]


class SharedBias(torch.nn.Module):
    """One parameter read by both stages of a two-stage cut, as a get_attr node."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4))
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.first(x) + self.bias)
        return self.second(x) * self.bias


def test_a_shared_parameter_is_bound_by_each_reader_never_sent(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SharedBias()
    x = torch.randn(3, 4)
    traced = trace(model, (x,))
    plan = contiguous_plan(traced.gm.graph, 2)
    cut = cut_stages(traced.gm.graph, plan.stage_of(), 2)
    assert all("bias" in io.nodes for io in cut)
    assert [io.inputs for io in cut] == [("x",), ("relu",)]
    # the parameter is not an output of the first stage: the second binds its own
    assert [io.outputs for io in cut] == [("relu",), ("mul",)]

    write_package(tmp_path / "pkg", traced, plan)
    package = import_package(tmp_path / "pkg")
    stages = package.build_stages(model)
    assert [s.OUTPUTS for s in stages] == [io.outputs for io in cut]
    got = run_stages(package, stages, (x,), {})
    got.sum().backward()
    split_grad = model.bias.grad.clone()
    model.zero_grad(set_to_none=True)
    want = model(x)
    want.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(split_grad, model.bias.grad)


def test_the_plan_records_the_cut_the_stages_use(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli.main(["split", str(ROOT / "examples" / "gpt.py"), "--gpus", "3",
                     "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    package = import_package(out)
    classes = [getattr(package, f"stage{k}") for k in range(plan["num_stages"])]
    recorded = [(tuple(s["inputs"]), tuple(s["outputs"])) for s in plan["stages"]]
    generated = [
        (getattr(module, f"Stage{k}").INPUTS, getattr(module, f"Stage{k}").OUTPUTS)
        for k, module in enumerate(classes)
    ]
    assert recorded == generated
    assert all(outputs for _inputs, outputs in recorded)
