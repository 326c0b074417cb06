"""measured.json is checked before anything compares a plan with it: a value no training
step measures, a measurement of another plan, or a model that is not the measured plan's
is one line on stderr and exit 2, from `fxpipe report` and `fxpipe split --calibrate`
alike; a measurement written before measurements named their plan is compared with a
one-line warning."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.cli import main
from fxpipe.compiler import SplitOptions, analyze_file, output_files, plan_split
from fxpipe.cost_models import get_device
from fxpipe.output import write_folder
from fxpipe.plan import Plan
from fxpipe.runtime.measure import Measurement
from fxpipe.runtime.measured_file import FORMAT, VERSION, plan_identity

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
K, M = 3, 4

# A model of five ops, none named as any of the MLP's
OTHER = '''
import torch
import torch.nn.functional as F
from torch import nn


class Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(64, 128)
        self.mix = nn.Linear(128, 128)
        self.proj_out = nn.Linear(128, 10)

    def forward(self, x):
        return self.proj_out(torch.tanh(self.mix(torch.tanh(self.proj_in(x)))))


def build_model():
    torch.manual_seed(0)
    return Other()


def example_inputs():
    return (torch.randn(8, 64, generator=torch.Generator().manual_seed(1)),)


def example_target():
    return torch.randn(8, 10, generator=torch.Generator().manual_seed(2))


def loss_fn(output, target):
    return F.mse_loss(output, target)
'''


def _planned(model: str, out: Path) -> Plan:
    """``model`` planned for K CPU stages and M micro-batches, written to ``out``."""
    cpu = get_device("cpu")
    source, traced = analyze_file(model, device=cpu)
    options = SplitOptions(gpus=K, device=cpu, memory_limit=float(cpu.memory_bytes),
                           microbatches=M)
    plan = plan_split(traced, label=source.label, options=options)
    write_folder(out, output_files(traced, plan, label=source.label))
    return plan


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Plan]]:
    """The example MLP's plan and another model's, of the same K and M, each in a folder."""
    root = tmp_path_factory.mktemp("plans")
    other = root / "other.py"
    other.write_text(OTHER)
    return {name: (root / name, _planned(model, root / name))
            for name, model in (("mlp", MLP), ("other", str(other)))}


def _measurement(plan: Plan) -> dict[str, Any]:
    """A measured.json of ``plan`` that measured exactly what it predicted."""
    identity = plan_identity(plan.to_dict())
    return {
        "format": FORMAT, "version": VERSION, "device": "cpu", "clock": "wall",
        "plan": {"model": identity.model, "fingerprint": identity.fingerprint},
        "serial": False, "microbatches": plan.microbatches, "warmup_steps": 1, "steps": 2,
        "step_s": plan.estimate.iteration_s,
        "stages": [{"index": s.index, "forward_s": s.forward_s, "backward_s": s.backward_s,
                    "comm_s": s.comm_s, "peak_memory_bytes": None, "device": "cpu"}
                   for s in plan.stages],
    }


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``fxpipe ARGV``: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _refused_by_both(folder: Path, path: Path, never: Path) -> list[str]:
    """``path`` passed to `fxpipe report` and to `fxpipe split --calibrate` (against the
    plan.json in ``folder``, copied beside it): each exits 2 with one line and nothing
    else, and writes nothing; the two errors."""
    (path.parent / "plan.json").write_text((folder / "plan.json").read_text())
    errors = []
    for argv in (["report", str(folder), str(path)],
                 ["split", MLP, "--gpus", str(K), "--calibrate", str(path), "--out", str(never)]):
        code, out, err = _run(argv)
        assert (code, out) == (2, ""), (argv, code, out, err)
        assert err.startswith("fxpipe: error: ") and err.count("\n") == 1, err
        errors.append(err)
    assert not never.exists()
    return errors


# (field: a top-level key, or (stage, key), the impossible value, what the error calls it)
IMPOSSIBLE = [
    ((1, "backward_s"), math.nan, "stage 1's backward_s is nan"),
    ((0, "forward_s"), -0.001, "stage 0's forward_s is -0.001"),
    ((2, "forward_s"), 0.0, "stage 2's forward_s is 0.0"),
    ((1, "comm_s"), math.inf, "stage 1's comm_s is inf"),
    ((0, "comm_s"), -1.0, "stage 0's comm_s is -1.0"),
    ((2, "backward_s"), True, "stage 2's backward_s is True"),
    ((0, "forward_s"), "0.1", "stage 0's forward_s is '0.1'"),
    ((1, "peak_memory_bytes"), -5, "stage 1's peak_memory_bytes is -5"),
    ("step_s", 0, "step_s is 0"),
    ("step_s", -math.inf, "step_s is -inf"),
    ("steps", 0, "steps is 0"),
    ("steps", 2.5, "steps is 2.5"),
    ("microbatches", 0, "microbatches is 0"),
    ("warmup_steps", -1, "warmup_steps is -1"),
]


def _with(data: dict[str, Any], field: str | tuple[int, str], value: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(data))
    if isinstance(field, tuple):
        data["stages"][field[0]][field[1]] = value
    else:
        data[field] = value
    return data


@pytest.mark.parametrize(("field", "value", "named"), IMPOSSIBLE)
def test_a_value_no_step_measures_is_refused_by_report_and_calibrate(
    plans: dict[str, tuple[Path, Plan]], tmp_path: Path, field: str | tuple[int, str],
    value: Any, named: str,
) -> None:
    folder, plan = plans["mlp"]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(_with(_measurement(plan), field, value)))
    for err in _refused_by_both(folder, path, tmp_path / "never"):
        assert f"{path}: {named}, which no step measures" in err, err
        assert "measure again" in err, err


TIMES = ("forward_s", "backward_s", "comm_s")


@st.composite
def _impossible(draw: st.DrawFn) -> tuple[str | tuple[int, str], Any]:
    """A field of a measured.json and a value no training step can give it."""
    not_a_number = st.one_of(st.booleans(), st.text(max_size=5), st.none(),
                             st.lists(st.integers(), max_size=2))
    broken = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]),
                       st.floats(max_value=-1e-12, allow_nan=False),
                       st.integers(max_value=-1), not_a_number)
    field = draw(st.sampled_from([*((k, key) for k in range(K) for key in TIMES),
                                  *((k, "peak_memory_bytes") for k in range(K)),
                                  "step_s", "steps", "microbatches", "warmup_steps"]))
    key = field[1] if isinstance(field, tuple) else field
    if key in ("forward_s", "backward_s", "step_s"):  # a step takes time
        value = draw(st.one_of(broken, st.sampled_from([0, 0.0, -0.0])))
    elif key == "comm_s":  # 0 where a stage sends nothing
        value = draw(broken)
    else:  # counts: whole numbers, at least 1 (0 for the warm-up)
        least = 0 if key == "warmup_steps" else 1
        whole = st.integers(max_value=least - 1)
        fraction = st.floats(allow_nan=True).filter(lambda x: not float(x).is_integer())
        value = draw(st.one_of(whole, fraction, not_a_number.filter(lambda v: v is not None)))
    return field, value


@settings(max_examples=60, deadline=None)
@given(case=_impossible())
def test_every_impossible_measurement_is_refused_in_one_line(
    plans: dict[str, tuple[Path, Plan]], tmp_path_factory: pytest.TempPathFactory,
    case: tuple[str | tuple[int, str], Any],
) -> None:
    field, value = case
    folder, plan = plans["mlp"]
    path = tmp_path_factory.mktemp("impossible") / "measured.json"
    path.write_text(json.dumps(_with(_measurement(plan), field, value)))
    named = f"stage {field[0]}'s {field[1]}" if isinstance(field, tuple) else field
    for err in _refused_by_both(folder, path, path.parent / "never"):
        assert str(path) in err and (named in err or "malformed" in err), err


def test_a_measurement_of_another_plan_is_refused(
    plans: dict[str, tuple[Path, Plan]], tmp_path: Path,
) -> None:
    """The other model's plan has the MLP plan's K and M, so only the plan it names tells
    the two apart."""
    (folder, plan), (_, other) = plans["mlp"], plans["other"]
    assert (other.num_stages, other.microbatches) == (plan.num_stages, plan.microbatches)
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(_measurement(other)))
    measured, given = plan_identity(other.to_dict()), plan_identity(plan.to_dict())
    assert measured.fingerprint != given.fingerprint
    report, calibrate = _refused_by_both(folder, path, tmp_path / "never")
    # report reads the plan in the folder given, --calibrate the one beside the measurement
    for err, plan_file in ((report, folder / "plan.json"), (calibrate, tmp_path / "plan.json")):
        assert err == (f"fxpipe: error: {path} measured other.py:build_model (plan "
                       f"{measured.fingerprint}), not {plan_file}, mlp.py:build_model (plan "
                       f"{given.fingerprint}); pass the folder of the plan that was measured, "
                       f"or measure again (runner.measure(...) and card.save, or "
                       f"train_torchrun.py --measure) with this plan's package\n")

    # the same model planned with other micro-batches is another plan too
    data = _measurement(plan)
    data["plan"]["fingerprint"] = plan_identity(
        {**plan.to_dict(), "microbatches": M + 1}).fingerprint
    path.write_text(json.dumps(data))
    for err in _refused_by_both(folder, path, tmp_path / "never"):
        assert f"{path} measured mlp.py:build_model (plan {data['plan']['fingerprint']})" in err


def test_a_measurement_naming_no_plan_is_compared_with_a_one_line_warning(
    plans: dict[str, tuple[Path, Plan]], tmp_path: Path,
) -> None:
    folder, plan = plans["mlp"]
    data = _measurement(plan)
    del data["plan"]  # as written before measurements named their plan
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(data))
    code, out, err = _run(["report", str(folder), str(path)])
    assert code == 0 and out.startswith("# Report card: mlp.py:build_model on cpu")
    assert err.startswith(f"fxpipe: warning: {path} does not name the plan it measured")
    assert err.count("\n") == 1 and "measure again" in err

    data["plan"] = None  # as the runtime writes it outside a generated package
    path.write_text(json.dumps(data))
    assert _run(["report", str(folder), str(path)])[2] == err


def test_report_and_calibrate_refuse_a_model_that_is_not_the_measured_plans(
    plans: dict[str, tuple[Path, Plan]], tmp_path: Path,
) -> None:
    """Not "N of N nodes move": none of the other model's ops is in the measured plan."""
    folder, plan = plans["mlp"]
    other = str(folder.parent / "other.py")
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(_measurement(plan)))
    (tmp_path / "plan.json").write_text((folder / "plan.json").read_text())
    # report prints no card before refusing; split has said what it traced
    for argv in (["report", str(folder), str(path), "--model", other],
                 ["split", other, "--gpus", str(K), "--calibrate", str(path),
                  "--out", str(tmp_path / "never")]):
        code, out, err = _run(argv)
        assert code == 2 and (out == "" or argv[0] == "split"), (argv, out, err)
        assert err.count("\n") == 1, err
        assert err.startswith("fxpipe: error: only 0 of this model's 5 ops are in the plan "
                              "that was measured (this model has proj_in, tanh, mix, ..."), err
        assert "measure this model's own plan" in err
    assert not (tmp_path / "never").exists()

    # the model the plan was made from re-plans as before
    code, out, err = _run(["report", str(folder), str(path), "--model", MLP])
    assert (code, err) == (0, "") and "Re-planned mlp.py:build_model" in out


@pytest.mark.parametrize("figure", [math.nan, 0.0])
def test_save_refuses_a_card_no_step_measures_and_writes_nothing(
    tmp_path: Path, figure: float,
) -> None:
    card = Measurement(2, M, warmup=0)
    card.add_step([{"forward": 1.0, "backward": 2.0, "comm": 0.0},
                   {"forward": 1.0, "backward": figure, "comm": 0.0}], 4.0)
    path = tmp_path / "measured.json"
    with pytest.raises(ValueError, match=rf"{path}: stage 1's backward_s is {figure!r}, "
                                         r"which no step measures"):
        card.save(path)
    assert not path.exists()
    card.totals[0][1]["backward"] = 2.0
    assert json.loads(card.save(path).read_text())["plan"] is None  # not a package's runtime
