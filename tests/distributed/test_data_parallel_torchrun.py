"""A pipeline is one of several on the job: two pipelines of two stages on four ranks,
each given its own process group, their gradients then averaged over the data-parallel
dimension (data_parallel.py). The GPT's embedding is tied to its LM head across the two
stages: each pipeline sums the tied gradient over its own two ranks, and every
parameter's gradient equals the unsplit model's on the global mini-batch."""

from __future__ import annotations

from pathlib import Path

import torch

from . import data_parallel
from ._helpers import EXAMPLES, contiguous_plan, load, mini_batch, torchrun, write_package


def test_two_pipelines_on_their_own_groups_give_the_models_gradients(tmp_path: Path) -> None:
    model_file = EXAMPLES / "gpt.py"
    source, traced = load(str(model_file))
    files = write_package(tmp_path / "pkg", traced, contiguous_plan(
        traced.gm.graph, 2, schedule="1f1b", microbatches=2))
    assert '{0: "tok_emb.weight", 1: "lm_head.weight"}' in files["distributed.py"]
    # the global mini-batch: two pipelines of M = 2 micro-batches of the example's rows
    ids, target = mini_batch(mini_batch(source.args))[0], mini_batch(mini_batch(source.target))
    torch.save({"args": (ids,), "target": target}, tmp_path / "batch.pt")
    result = torchrun(4, Path(data_parallel.__file__), str(tmp_path / "pkg"), str(model_file),
                      str(tmp_path / "batch.pt"), str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]

    model = source.model
    model.zero_grad(set_to_none=True)
    source.loss_fn(model(ids), target).backward()
    expected = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    seen = set()
    for rank in range(4):
        for name, grad in torch.load(tmp_path / "out" / f"rank{rank}.pt")["grads"].items():
            seen.add(name)
            torch.testing.assert_close(
                grad, expected[name], rtol=1e-4, atol=1e-5,
                msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")
    assert seen == set(expected)
