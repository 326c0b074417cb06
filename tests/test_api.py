"""fxpipe from Python (``fxpipe.split``, ``split_file``, ``load_package``): the plan the
command line makes, the package it writes, and its checks worded for Python."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxpipe
from tests._cli import fxpipe as command

# a model file; the script below builds the same model in itself
NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(8, 16),)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


def example_target():
    return torch.zeros(8, 4)
"""


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder ``fxpipe split model.py --gpus 2 --precision bf16-mixed`` wrote."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "model.py").write_text(NET)
    done = command("split", "model.py", "--gpus", "2", "--pp", "2", "--precision",
                   "bf16-mixed",
                   "--out", "out", cwd=folder)
    assert done.returncode == 0, done.stderr
    return folder


def test_the_commands_last_line_names_what_a_person_opens(tmp_path: Path) -> None:
    """The folder, its report.html, report.md and plan.json, and a count of the stage
    modules and of the files: not the runtime's thirty file names."""
    (tmp_path / "model.py").write_text(NET)
    done = command("split", "model.py", "--gpus", "2", "--pp", "2", "--out", "out",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file() and p.name != ".fxpipe"]
    assert last.endswith(f"wrote out/ (report.html, report.md, plan.json and 2 stage "
                         f"modules; {len(files)} files in all)"), last


def test_a_model_built_in_a_script_gets_the_command_lines_plan(planned: Path) -> None:
    """``python -c "import fxpipe; plan = fxpipe.split(...)"`` on the model the file builds,
    built in the script itself: plan.to_json() is the command's plan.json, byte for byte."""
    body = NET.replace("def build_model", "def _build")
    script = body + textwrap.dedent("""
        import fxpipe
        plan = fxpipe.split(_build(), example_inputs(), gpus=2, pp=2, precision="bf16-mixed",
                            loss_fn=loss_fn, example_target=example_target(),
                            label="model.py:build_model")
        print(plan.to_json(), end="")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=planned)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (planned / "out" / "plan.json").read_text()
    assert '"precision": "bf16-mixed"' in done.stdout


def test_split_file_writes_the_command_lines_folder(planned: Path, tmp_path: Path) -> None:
    plan = fxpipe.split_file(planned / "model.py", gpus=2, pp=2, precision="bf16-mixed",
                             out=tmp_path / "pipe")
    assert plan.to_json() == (planned / "out" / "plan.json").read_text()
    wrote = {p.relative_to(tmp_path / "pipe").as_posix()
             for p in (tmp_path / "pipe").rglob("*") if p.is_file()}
    cli = {p.relative_to(planned / "out").as_posix()
           for p in (planned / "out").rglob("*") if p.is_file()}
    assert wrote == cli
    for name in ("stage0.py", "stage1.py", "runner.py", "report.md"):
        assert (tmp_path / "pipe" / name).read_text() == (planned / "out" / name).read_text()


def test_the_package_written_trains_as_the_model(tmp_path: Path) -> None:
    """A model built here, split with out=, loaded with fxpipe.load_package: one step
    of the runner gives the model's loss and gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x, target = torch.randn(4, 8), torch.randn(4, 2)
    plan = fxpipe.split(model, x, gpus=2, pp=2, microbatches=2, out=tmp_path / "pipe")
    assert plan.num_stages == 2 and plan.model == "Sequential"
    pipe = fxpipe.load_package(tmp_path / "pipe")
    runner = pipe.PipelineRunner(pipe.build_stages(model))
    loss = runner.step((x,), target, torch.nn.functional.mse_loss)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = torch.nn.functional.mse_loss(model(x), target)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for grad, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(grad, p.grad)


@pytest.mark.parametrize(("keywords", "message"), [
    ({"gpus": 0}, "gpus must be at least 1, got 0"),
    ({"gpus": 2, "virtual_stages": 2, "schedule": "gpipe"},
     "virtual_stages=2 needs schedule='interleaved', not gpipe"),
    ({"gpus": 2, "schedule": "interleaved"},
     "schedule='interleaved' needs virtual_stages=2 or more"),
    ({"gpus": 2, "pp": 2, "microbatches": 2000},
     "microbatches=2000 is more than 1024: runner.py lists every forward and backward of "
     "every micro-batch; use microbatches=1024 or fewer (bigger micro-batches)"),
    ({"gpus": 2, "recompute": "some"}, "recompute takes one of auto, "),
    ({"gpus": 2, "schedule": "1f2b"}, "schedule takes one of gpipe, 1f1b, interleaved, "),
    ({"gpus": 2, "optimizer": "lion"}, "optimizer takes one of adam, sgd, sgd-momentum, got"),
    ({"gpus": 2, "dp_mode": "zero"}, "dp_mode takes one of fsdp, ddp, got 'zero'"),
    ({"gpus": 2, "pp": "half"}, "pp takes auto or a number, got 'half'"),
    ({"gpus": 2, "time_limit": float("nan")},
     "time_limit must be a positive number of seconds, got nan"),
    ({"gpus": 2, "memory": "lots"}, "cannot read 'lots' as a size"),
    ({"gpus": 2, "device": "h900"}, "unknown device 'h900'"),
    ({"gpus": 2, "diagram": "ops"}, "diagram takes one of module, op, got 'ops'"),
])
def test_a_mistake_is_one_line_naming_the_keyword(keywords: dict[str, object],
                                                  message: str, tmp_path: Path) -> None:
    """The command line's checks, worded with the keywords; refused before tracing and
    before anything is written."""
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as raised:
        fxpipe.split(model, (torch.ones(2, 4),), out=tmp_path / "out",
                     **keywords)  # type: ignore[arg-type]
    assert str(raised.value).startswith(message), str(raised.value)
    assert "\n" not in str(raised.value) and "--" not in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_the_options_are_the_keywords_split_options_checks() -> None:
    """``split`` and ``split_file`` take as options (``SplitKeywords``) every keyword of
    ``split_options``, of its type, and nothing else; ``gpus`` is required, as there."""
    from fxpipe.request import SplitKeywords, split_options

    parameters = inspect.signature(split_options).parameters
    checked = {name: p.annotation for name, p in parameters.items() if name != "spelling"}
    declared = {name: ref.__forward_arg__ for name, ref in SplitKeywords.__annotations__.items()}
    required = {name for name, p in parameters.items() if p.default is inspect.Parameter.empty}
    assert required == {"gpus"} and declared["gpus"] == "Required[int]"
    assert {**declared, "gpus": "int"} == checked


def test_example_inputs_of_another_kind_are_refused() -> None:
    with pytest.raises(ValueError, match="example_inputs is a str; pass one micro-batch"):
        fxpipe.split(torch.nn.Linear(4, 4), "x", gpus=1)


def test_import_fxpipe_imports_no_torch_until_split_is_called() -> None:
    code = ("import sys, fxpipe; print('torch' in sys.modules, sorted(fxpipe.__all__)); "
            "split = fxpipe.split; print('torch' in sys.modules)\n"
            "try: split(None, (), gpus=0)\n"
            "except ValueError: print('torch' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
    imported, looked_up, called = found.stdout.splitlines()
    assert imported == "False ['Plan', '__version__', 'load_package', 'split', 'split_file']"
    assert (looked_up, called) == ("False", "True")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'splits'"):
        fxpipe.splits  # noqa: B018


def test_calibrate_re_plans_as_the_command_does(planned: Path, tmp_path: Path) -> None:
    """A step measured by the runner of the command's package, then fxpipe.split_file
    with calibrate=: the plan ``fxpipe split --calibrate`` makes from the same file."""
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("api_net", planned / "model.py")
    assert spec is not None and spec.loader is not None
    net = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(net)
    model = net.build_model()
    shutil.copytree(planned / "out", tmp_path / "measured")  # the plan.json beside it
    pipe = fxpipe.load_package(tmp_path / "measured")
    runner = pipe.PipelineRunner(pipe.build_stages(model))
    inputs, target = torch.randn(16, 16), torch.zeros(16, 4)
    with runner.measure(warmup=1) as card:
        for _ in range(2):
            runner.step((inputs,), target, net.loss_fn)
    measured = tmp_path / "measured" / "measured.json"
    card.save(measured)
    done = command("split", "model.py", "--gpus", "2", "--pp", "2", "--precision",
                   "bf16-mixed",
                   "--calibrate", measured, "--out", tmp_path / "cli", cwd=planned)
    assert done.returncode == 0, done.stderr
    plan = fxpipe.split_file(planned / "model.py", gpus=2, pp=2, precision="bf16-mixed",
                             calibrate=measured, out=tmp_path / "api")
    assert plan.to_json() == (tmp_path / "cli" / "plan.json").read_text()
    assert any("calibrated" in note for note in plan.notes), plan.notes
    assert ((tmp_path / "api" / "calibrated_from.json").read_text()
            == measured.read_text())
