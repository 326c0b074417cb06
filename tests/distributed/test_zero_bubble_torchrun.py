"""Transparency of the zero-bubble schedules across processes: a generated package planned
with zb1p, zbv or dualpipev, its train_torchrun.py under a real ``torchrun
--nproc-per-node 2`` (gloo, CPU) on torch's ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble and ScheduleDualPipeV, gives the unsplit model's outputs, loss and
every gradient.

ZB-H1 runs 2 stages on 2 ranks; ZB-V and DualPipeV run 4 stages in a V (rank 0: stages 0
and 3, rank 1: stages 1 and 2), so the GPT's embedding and its tied LM head are one
parameter on rank 0, which two stages' weight gradients add into, and the U-Net's
encoder-to-decoder skips go from rank 0 through rank 1 and back. M = 4 micro-batches,
all different: a gradient divided by M twice, or a weight gradient left out, shows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

from ._helpers import EXAMPLES, contiguous_plan, import_package, load, torchrun
from ._helpers import write_package as write

M = 4

# (example, schedule, recompute: on stages 0 and 2, which run their forward again in the
# input gradient and once more in the weight gradient); the slow tier covers the other
# combinations
CASES = [
    ("gpt", "zb1p", False),
    ("gpt", "zbv", True),
    ("gpt", "dualpipev", False),
    ("unet", "zbv", False),
    *(pytest.param(name, schedule, recompute, marks=pytest.mark.slow)
      for name, schedule, recompute in [
          ("gpt", "zbv", False),
          ("unet", "zb1p", True),
          ("unet", "dualpipev", True),
          ("llama", "zb1p", False),
          ("llama", "zbv", False),
          ("llama", "dualpipev", False),
      ]),
]


def four_microbatches(value: object) -> object:
    """M = 4 different micro-batches from the example: as is, and flipped along dim 0, the
    last dim, and both."""
    def variants(t: torch.Tensor) -> torch.Tensor:
        if not t.dim():
            return t
        return torch.cat([t, t.flip(0), t.flip(-1), t.flip(0).flip(-1)])
    return pytree.tree_map_only(torch.Tensor, variants, value)


@pytest.mark.parametrize(("name", "schedule", "recompute"), CASES)
def test_zero_bubble_torchrun_matches_the_model(tmp_path: Path, name: str, schedule: str,
                                                recompute: bool) -> None:
    model_file = EXAMPLES / f"{name}.py"
    source, traced = load(str(model_file))
    v_placed = schedule != "zb1p"
    k = 4 if v_placed else 2
    plan = contiguous_plan(traced.gm.graph, k, schedule=schedule, microbatches=M,
                           recompute=tuple(recompute and j % 2 == 0 for j in range(k)))
    if v_placed:
        plan = dataclasses.replace(plan, virtual_stages=2)
    files = write(tmp_path / "pkg", traced, plan)
    assert "torchrun --nproc-per-node 2 train_torchrun.py" in files["train_torchrun.py"]
    model = source.model
    torch.save(model.state_dict(), tmp_path / "model.pt")
    args, kwargs = four_microbatches(source.args), four_microbatches(source.kwargs)
    target = four_microbatches(source.target)
    torch.save({"args": args, "kwargs": kwargs, "target": target}, tmp_path / "batch.pt")

    result = torchrun(2, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model_file),
                      "--checkpoint", str(tmp_path / "model.pt"), "--batch",
                      str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"), "--lr", "0")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    torch_class = {"zb1p": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}[schedule]
    assert f"{schedule} runs on torch's {torch_class}" in result.stdout
    assert f"{schedule} runs on torch's {torch_class}" in files["train_torchrun.py"]
    ranks = [torch.load(tmp_path / "out" / f"rank{rank}.pt") for rank in range(2)]

    model.zero_grad(set_to_none=True)
    want = model(*args, **kwargs)
    want_loss = source.loss_fn(want, target)
    want_loss.backward()
    want_grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}

    # the last stage runs on rank 0 in a V, on the last rank otherwise
    last = 0 if v_placed else 1
    assert ranks[1 - last]["loss"] is None and not ranks[1 - last]["outputs"]
    close = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(ranks[last]["loss"], want_loss.detach(), **close)
    outputs = ranks[last]["outputs"]
    assert len(outputs) == M
    got = [torch.cat(parts) for parts in zip(*map(pytree.tree_leaves, outputs), strict=True)]
    for a, b in zip(got, pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b.detach(), **close)
    seen = set()
    for rank, saved in enumerate(ranks):
        assert saved["grads"], f"rank {rank} saved no gradients"
        for key, grad in saved["grads"].items():
            seen.add(key)
            torch.testing.assert_close(grad, want_grads[key], **close,
                                       msg=lambda m, key=key, rank=rank: f"rank {rank} {key}: {m}")
    named = dict(model.named_parameters(remove_duplicate=False))
    assert {id(named[key]) for key in seen} == {id(p) for p in model.parameters()}
    if name == "gpt" and v_placed:  # the tied weight: one copy, on rank 0, both stages' sum
        assert {"tok_emb.weight", "lm_head.weight"} <= set(ranks[0]["grads"])
        assert not {"tok_emb.weight", "lm_head.weight"} & set(ranks[1]["grads"])


def _package(tmp_path: Path, schedule: str, k: int, m: int, v: int = 1,
             replicas: tuple[int, ...] | None = None) -> object:
    _, traced = load(str(EXAMPLES / "gpt.py"))
    plan = contiguous_plan(traced.gm.graph, k, schedule=schedule, microbatches=m,
                           virtual_stages=v, replicas=replicas)
    write(tmp_path / schedule, traced, plan)
    return import_package(tmp_path / schedule, f"fxpipe_zb_errors_{schedule}_{k}_{m}")


def test_what_torch_needs_is_said_before_any_stage_is_built(tmp_path: Path) -> None:
    """torch's classes want M in equal rounds (zb1p), two stages per rank in the plan's V
    (zbv, dualpipev) and M >= K (dualpipev): one sentence with the numbers and the fix."""
    zb1p = _package(tmp_path, "zb1p", 2, 5)
    with pytest.raises(ValueError, match=r"zb1p runs on torch's ScheduleInterleavedZeroBubble "
                       r"with one stage per rank \(2 stages on 2 ranks\) and M = 5 micro-batches "
                       r"in max\(1, M // 2\) = 2 equal rounds: split again with --microbatches 6"):
        zb1p.build_schedule([None], None)
    with pytest.raises(ValueError, match=r"zbv runs on torch's ScheduleZBVZeroBubble with "
                       r"exactly 2 stages per rank in a V, rank r running stages r and 1 - r "
                       r"\(2 stages on 2 ranks\): split again with --schedule zbv"):
        zb1p.build_schedule([None], None, schedule="zbv")
    dualpipev = _package(tmp_path, "dualpipev", 4, 4, v=2)
    assert dualpipev.distributed.PIPELINE.stages_of(0) == (0, 3)
    with pytest.raises(ValueError, match=r"at least as many micro-batches as stages \(M = 3\): "
                       r"split again with --microbatches 4"):
        dualpipev.build_schedule([None, None], None, microbatches=3)


def test_replicated_zero_bubble_stages_are_refused(tmp_path: Path) -> None:
    source, _ = load(str(EXAMPLES / "gpt.py"))
    package = _package(tmp_path, "zb1p", 2, 2, replicas=(1, 2))
    with pytest.raises(ValueError, match=r"this plan's zb1p stages are replicated \(1-2\), "
                       r"which a schedule that splits the backward does not run"):
        package.pipeline_stages(source.model, 0, 3, "cpu", *source.args)


def test_a_schedule_that_places_the_stages_otherwise_is_refused(tmp_path: Path) -> None:
    """torch's classes send activations to the ranks their own placement says: a V-placed
    plan under interleaved 1F1B (stage j on rank j % N), or 1F1B's one stage per rank under
    a V, would run a placement the plan did not choose. One sentence naming the plan's
    schedule and the fix, before any stage is needed; a kind with the same placement runs."""
    zbv = _package(tmp_path, "zbv", 4, 4, v=2)
    assert zbv.distributed.PIPELINE.stages_of(0) == (0, 3)
    with pytest.raises(ValueError, match=r"^this plan was split for zbv, stage j on rank "
                       r"\[0, 1, 1, 0\]\[j\]; interleaved runs several stages per rank, stage "
                       r"j on rank j % 2 \(4 stages on 2 ranks\): split again with --schedule "
                       r"interleaved$"):
        zbv.build_schedule([None, None], None, schedule="interleaved")
    for kind in ("1f1b", "gpipe", "zb1p"):
        with pytest.raises(ValueError, match=rf"^this plan was split for zbv, .*; {kind} runs "
                           rf"(on torch's \w+ with )?one stage per rank \(4 stages on 2 "
                           rf"ranks\): split again with --schedule {kind}$"):
            zbv.build_schedule([None, None], None, schedule=kind)
    dualpipev = _package(tmp_path, "dualpipev", 4, 4, v=2)
    with pytest.raises(ValueError, match=r"^this plan was split for dualpipev, .*; interleaved "
                       r"runs .*: split again with --schedule interleaved$"):
        dualpipev.build_schedule([None, None], None, schedule="interleaved")
    one_f_one_b = _package(tmp_path, "1f1b", 2, 4)
    for kind in ("zbv", "dualpipev", "interleaved"):
        with pytest.raises(ValueError, match=rf"^this plan was split for 1f1b, stage j on rank "
                           rf"\[0, 1\]\[j\]; {kind} runs .*: split again with --schedule "
                           rf"{kind}$"):
            one_f_one_b.build_schedule([None], None, schedule=kind)
    interleaved = _package(tmp_path, "interleaved", 4, 4, v=2)
    with pytest.raises(ValueError, match=r"^this plan was split for interleaved, stage j on "
                       r"rank \[0, 1, 0, 1\]\[j\]; zbv runs on torch's ScheduleZBVZeroBubble"):
        interleaved.build_schedule([None, None], None, schedule="zbv")
    # the same V: the placement check passes, and torch's class is what then fails on
    # stages that are not there
    with pytest.raises(AttributeError):
        zbv.build_schedule([None, None], None, schedule="dualpipev")
