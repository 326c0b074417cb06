"""A plan's layout trained for one step under torchrun, and what the tests check of it:
``fxpipe split MODEL --gpus N --pp P --dp-mode MODE --schedule S``, then the package's
train_torchrun.py on N gloo ranks with ``--batch`` (the global batch) and ``--save``;
against the unsplit model on the same batch, every rank's saved (whole) gradients, and
against plan.json, the bytes each rank holds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fxpipe import cli
from fxpipe.frontend import load_model_file

from . import gpt64, llama64, t5_64
from ._helpers import EXAMPLES, assert_model_grads, import_package, torchrun

__all__ = ["GPT", "GPT64", "LLAMA", "T5", "Model", "assert_plan_memory", "assert_unsplit",
           "run", "split", "unsplit"]


@dataclass(frozen=True)
class Model:
    """A model file and the error its gradients may have relative to the largest (float32's
    or float64's). Its inputs and target are token ids."""

    spec: str
    tolerance: float

    def batch(self, rows: int) -> dict[str, Any]:
        """A global batch of ``rows`` samples shaped as the example's, random token ids."""
        source = load_model_file(self.spec)
        generator = torch.Generator().manual_seed(0)
        ids = lambda t: torch.randint(3, 1000, (rows, *t.shape[1:]), generator=generator)  # noqa: E731
        return {"args": tuple(map(ids, source.args)),
                "kwargs": {k: ids(v) for k, v in source.kwargs.items()},
                "target": ids(source.target)}


GPT = Model(str(EXAMPLES / "gpt.py"), 1e-5)
GPT64 = Model(gpt64.__file__, 1e-12)  # the same GPT in float64
LLAMA = Model(llama64.__file__, 1e-12)  # HF Llama in float64, grouped-query attention
T5 = Model(t5_64.__file__, 1e-12)  # HF T5 in float64, traced by torch.export


def split(out: Path, model: Model, mode: str, *, gpus: int = 4, pp: int = 2,
          schedule: str = "1f1b") -> dict[str, Any]:
    """The package of ``model`` on ``gpus`` GPUs as pipelines of ``pp``, and its plan.json
    (interleaved: two stages per GPU)."""
    virtual = ["--virtual-stages", "2"] if schedule == "interleaved" else []
    assert cli.main(["split", model.spec, "--gpus", str(gpus), "--pp", str(pp), "--dp-mode",
                     mode, "--schedule", schedule, *virtual, "--out", str(out), "--force"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layout"]["dp"] == gpus // pp and plan["layout"]["dp_mode"] == mode
    return plan


def run(tmp_path: Path, model: Model, mode: str, *flags: str, gpus: int = 4, pp: int = 2,
        schedule: str = "1f1b") -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """Split, train one step under torchrun with ``flags``: (plan, batch, each rank's save)."""
    plan = split(tmp_path / "pkg", model, mode, gpus=gpus, pp=pp, schedule=schedule)
    batch = model.batch(plan["layout"]["global_batch"])
    torch.save(batch, tmp_path / "batch.pt")
    result = torchrun(gpus, tmp_path / "pkg" / "train_torchrun.py", "--model", model.spec,
                      "--batch", str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"),
                      *flags)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    saves = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False)
             for r in range(gpus)]
    return plan, batch, saves


def unsplit(model: Model, batch: dict[str, Any], clip: float | None
            ) -> tuple[float, dict[str, torch.Tensor], dict[str, int]]:
    """The unsplit model's loss on ``batch``, its gradients (clipped to ``clip``) and which
    parameter each name is (a tied one has several)."""
    source = load_model_file(model.spec)
    assert source.loss_fn is not None
    loss = source.loss_fn(source.model(*batch.get("args", ()), **batch.get("kwargs", {})),
                          batch["target"])
    loss.backward()
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(source.model.parameters(), clip)
        assert norm > clip, (norm, clip)  # clipping scales
    named = list(source.model.named_parameters(remove_duplicate=False))
    return float(loss.detach()), {n: p.grad for n, p in named}, {n: id(p) for n, p in named}


def assert_unsplit(saves: list[dict[str, Any]], model: Model, batch: dict[str, Any],
                   clip: float | None = None) -> float:
    """Every rank's whole gradients are the unsplit model's on ``batch`` (clipped to
    ``clip``), to the model's tolerance, every parameter on some rank; the unsplit loss."""
    loss, expected, which = unsplit(model, batch, clip)
    assert_model_grads(saves, expected, model.tolerance, which)
    return loss


def assert_plan_memory(package: Path, plan: dict[str, Any], saves: list[dict[str, Any]]
                       ) -> None:
    """Each rank holds, for the stages the plan puts on it (rank i·pp + j: those on GPU j
    of a pipeline), the plan's parameter, gradient and optimizer bytes summed over them:
    params and grads whole inside the step, and between steps 1/d of them under fsdp (its
    local shards), whole under ddp."""
    pp, dp, mode = plan["layout"]["pp"], plan["layout"]["dp"], plan["layout"]["dp_mode"]
    device_of = import_package(package, f"layout_{package.parent.name}").DEVICE_OF
    for rank, save in enumerate(saves):
        stages = [plan["stages"][k]["memory"] for k in range(plan["num_stages"])
                  if device_of[k] == rank % pp]
        held = save["memory"]
        assert {key: held[key] for key in ("params", "grads", "optimizer")} == {
            key: sum(stage[key] for stage in stages)
            for key in ("params", "grads", "optimizer")}, (rank, held, stages)
        shards = dp if mode == "fsdp" else 1
        assert held["params_local"] == held["params"] // shards, (rank, held)
        assert held["grads_local"] == held["grads"] // shards, (rank, held)
