"""`fxpipe split` with replicated stages, interleaved 1F1B and weight stashing, end to end:
the plan the solver chooses, the bubble the report prints, and the generated package
running it with the unsplit model's gradients."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from codegen._models import import_package
from distributed._helpers import torchrun

from fxpipe import cli

# Three small linear layers, then a heavy parameter-free mixing layer (scores over the
# sequence, per sample): on 4 GPUs one stage per GPU is stuck behind the mixing layer,
# while splitting its micro-batches over several GPUs costs only a small all-reduce.
DOMINANT = '''
import torch
from torch import nn

BATCH, SEQ, WIDTH = 8, 512, 64


class SelfMix(nn.Module):
    def forward(self, x):
        scores = x @ x.transpose(-1, -2) / WIDTH**0.5
        return scores.softmax(-1) @ x


class Dominant(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, WIDTH)
        self.mix = SelfMix()

    def forward(self, x):
        return self.mix(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def build_model():
    torch.manual_seed(0)
    return Dominant()


def example_inputs():
    return (torch.randn(BATCH, SEQ, WIDTH),)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


def example_target():
    return torch.randn(BATCH, SEQ, WIDTH)
'''


def split(folder: Path, *flags: str) -> dict:
    code = cli.main(["split", str(folder / "model.py"), "--out", str(folder / flags[-1]),
                     *flags[:-1]])
    assert code == 0
    return json.loads((folder / flags[-1] / "plan.json").read_text())


@pytest.fixture(scope="module")
def dominant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dominant")
    (folder / "model.py").write_text(textwrap.dedent(DOMINANT))
    return folder


def step_grads(package: object, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
               loss_fn: object, **runner_kwargs: object) -> tuple[torch.Tensor, dict]:
    runner = package.PipelineRunner(package.build_stages(model), **runner_kwargs)  # type: ignore[attr-defined]
    model.zero_grad(set_to_none=True)
    loss = runner.step((x,), y, loss_fn)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss, grads


def test_replicated_split_beats_every_unreplicated_one_and_keeps_gradients(
    dominant: Path,
) -> None:
    one_each = split(dominant, "--gpus", "4", "--pp", "4", "--microbatches", "4", "plain")
    replicated = split(dominant, "--gpus", "4", "--microbatches", "4", "--replicate", "rep")
    replicas = [s["replicas"] for s in replicated["stages"]]
    assert sum(replicas) == 4 and max(replicas) >= 2
    assert replicated["solver"]["status"] == "OPTIMAL"
    assert one_each["solver"]["status"] == "OPTIMAL"  # the best unreplicated split, proved
    ratio = one_each["estimate"]["bottleneck_s"] / replicated["estimate"]["bottleneck_s"]
    assert ratio > 1.2  # 1.33 when measured
    assert replicated["estimate"]["iteration_s"] < one_each["estimate"]["iteration_s"]
    config = "-".join(str(r) for r in replicas)
    assert f"configuration {config}" in (dominant / "rep" / "report.md").read_text()

    package = import_package(dominant / "rep")
    assert tuple(package.runner.REPLICAS) == tuple(replicas)
    # torchrun runs it too, one process per GPU (tests/distributed run such plans)
    assert package.distributed.PIPELINE.unsupported is None
    with pytest.raises(ValueError, match=rf"must equal the number of GPUs of the plan "
                       rf"\({config}\): launch with torchrun --nproc-per-node 4"):
        package.pipeline_stage(torch.nn.Linear(1, 1), 0, len(replicas), "cpu")
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(DOMINANT), namespace)
    model = namespace["build_model"]().double()  # type: ignore[operator]
    torch.manual_seed(1)
    x = torch.randn(4 * 8, 512, 64, dtype=torch.float64)  # M micro-batches of 8
    y = torch.randn(4 * 8, 512, 64, dtype=torch.float64)
    loss, grads = step_grads(package, model, x, y, namespace["loss_fn"])
    want = namespace["loss_fn"](model(x), y)  # type: ignore[operator]
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("flags", [["--gpus", "4", "--replicate"],
                                   ["--gpus", "2", "--pp", "2", "--virtual-stages", "2"]],
                         ids=["replicated", "interleaved"])
def test_solver_plan_trains_under_torchrun(dominant: Path, tmp_path: Path,
                                           flags: list[str]) -> None:
    """The solver's plan, one process per GPU under a real torchrun: the uneven 1-1-2,
    or 4 interleaved stages on 2 GPUs. The loss and every rank's gradients are the
    unsplit model's."""
    out = f"torchrun_{'_'.join(f.strip('-') for f in flags)}"
    plan = split(dominant, "--microbatches", "4", *flags, out)
    gpus = plan["num_stages"] // plan["virtual_stages"] if plan["virtual_stages"] > 1 else sum(
        s["replicas"] for s in plan["stages"])
    assert gpus == (2 if "--virtual-stages" in flags else 4)
    if "--replicate" in flags:
        assert max(s["replicas"] for s in plan["stages"]) > 1
    else:
        assert plan["num_stages"] == 4 and plan["schedule"] == "interleaved"
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(DOMINANT), namespace)
    model = namespace["build_model"]()  # type: ignore[operator]
    torch.save(model.state_dict(), tmp_path / "model.pt")
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4 * 8, 512, 64, generator=g), torch.randn(4 * 8, 512, 64, generator=g)
    torch.save({"args": (x,), "kwargs": {}, "target": y}, tmp_path / "batch.pt")

    package = dominant / out
    result = torchrun(gpus, package / "train_torchrun.py", "--model",
                      str(dominant / "model.py"), "--checkpoint", str(tmp_path / "model.pt"),
                      "--batch", str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"),
                      "--lr", "0")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt") for r in range(gpus)]
    want = namespace["loss_fn"](model(x), y)  # type: ignore[operator]
    want.backward()
    close = {"rtol": 1e-4, "atol": 1e-6}
    torch.testing.assert_close(ranks[-1]["loss"], want.detach(), **close)
    seen = set()
    for saved in ranks:
        for name, grad in saved["grads"].items():
            seen.add(name)
            torch.testing.assert_close(grad, model.get_parameter(name).grad, **close)
    assert seen == {name for name, _ in model.named_parameters()}


@pytest.mark.parametrize(
    ("flags", "K", "v"),
    [
        (["--schedule", "gpipe"], 2, 1),
        (["--schedule", "1f1b"], 2, 1),
        (["--schedule", "pipedream"], 2, 1),
        (["--virtual-stages", "2"], 2, 2),
    ],
)
def test_report_bubble_is_the_schedule_formula(
    dominant: Path, flags: list[str], K: int, v: int
) -> None:
    M = 4
    name = "-".join(flags).strip("-")
    plan = split(dominant, "--gpus", str(K), "--pp", str(K), "--microbatches", str(M), *flags,
                 name)
    assert plan["num_stages"] == K * v and plan["virtual_stages"] == v
    e = plan["estimate"]
    assert e["bubble_fraction"] == pytest.approx((K - 1) / (v * M + K - 1))
    assert e["bubble_ratio"] == pytest.approx((K - 1) / (v * M))
    report = (dominant / name / "report.md").read_text()
    assert (f"bubble {e['bubble_fraction']:.1%} of the step = (K − 1) / (v·M + K − 1) with "
            f"K={K}, v={v}, M={M}; {e['bubble_ratio']:.1%} of the ideal time") in report
    stashed = [s["memory"]["stashed"] for s in plan["stages"]]
    if "pipedream" in flags:  # a weight copy per micro-batch in flight: min(M, K - j)
        params = [s["memory"]["params"] for s in plan["stages"]]
        assert stashed == [p * min(M, K - j) for j, p in enumerate(params)]
    else:
        assert stashed == [0] * (K * v)


@pytest.mark.parametrize("schedule", ["zb1p", "zbv", "dualpipev"])
def test_zero_bubble_split_end_to_end(dominant: Path, schedule: str) -> None:
    """--schedule zb1p|zbv|dualpipev: V schedules get 2 stage modules per GPU placed in a
    V, the report prints B, W and the Zero Bubble fill, the waiting weight gradients'
    memory is counted, and the package's table splits every backward (its gradients are
    checked in tests/codegen/test_zero_bubble_runner.py)."""
    K, M = 2, 4
    plan = split(dominant, "--gpus", str(K), "--pp", str(K), "--microbatches", str(M),
                 "--schedule", schedule, schedule)
    v = 1 if schedule == "zb1p" else 2
    assert plan["schedule"] == schedule and plan["num_stages"] == K * v
    assert plan["virtual_stages"] == v
    stages = plan["stages"]
    assert all(s["backward_input_s"] + s["backward_weight_s"] == pytest.approx(s["backward_s"])
               for s in stages)
    assert any(s["backward_weight_s"] > 0 for s in stages)
    assert any(s["memory"]["deferred"] > 0 for s in stages)
    report = (dominant / schedule / "report.md").read_text()
    assert "(K − 1)(T_F + T_B − T_W) per GPU" in report
    assert "| bwd input (B) | bwd weight (W) |" in report
    assert b"weight gradient (W)" in (dominant / schedule / "schedule.svg").read_bytes()
    package = import_package(dominant / schedule)
    kinds = {kind for tick in package.SCHEDULE for _j, kind, _m in tick}
    assert kinds == {"F", "I", "W"}


def test_zero_bubble_flag_errors(dominant: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flags, message in [
        (["--schedule", "dualpipev", "--gpus", "2", "--microbatches", "3"],
         "use --microbatches 4"),
        (["--schedule", "zbv", "--gpus", "2", "--virtual-stages", "3"],
         "drop --virtual-stages 3"),
        (["--schedule", "zb1p", "--gpus", "2", "--replicate"],
         "--replicate and --schedule zb1p cannot be combined"),
    ]:
        code = cli.main(["split", str(dominant / "model.py"), "--out", str(dominant / "bad"),
                         *flags])
        assert code == 2
        assert message in capsys.readouterr().err
        assert not (dominant / "bad").exists()
