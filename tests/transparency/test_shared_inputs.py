"""Inputs without a batch dimension are handed whole to every micro-batch: a (T, T)
causal mask shared by every sample (T equal to the micro-batch count, so splitting it
along dim 0 would silently give each micro-batch one row that broadcasts), and an
HF-style ``position_ids`` of shape (1, T). The pipeline must equal the unsplit model on
the whole mini-batch: outputs, loss and every gradient."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fxpipe.batching import BatchDimsError, decide_batching

from ._compile import compile_package

M, T, D = 4, 4, 8  # micro-batches, sequence length (= M), width


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.mid = nn.Linear(D, D)
        self.out = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / D**0.5 + mask
        h = torch.softmax(scores, dim=-1) @ v
        return self.out(torch.tanh(self.mid(h)))


class Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(11, D)
        self.positions = nn.Embedding(T, D)
        self.mid = nn.Linear(D, D)
        self.out = nn.Linear(D, 3)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(input_ids) + self.positions(position_ids)
        return self.out(torch.relu(self.mid(h)))


def causal_mask() -> torch.Tensor:
    return torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)


def _check(model: nn.Module, args: tuple[Any, ...], example: tuple[Any, ...], tmp: Path,
           schedule: str, shared: tuple[str, ...]) -> None:
    reference = copy.deepcopy(model)
    _, package = compile_package(model, example, tmp, gpus=2, microbatches=M,
                                 schedule=schedule)
    assert tuple(package.PLAN["shared_inputs"]) == shared
    assert any("handed whole to every micro-batch" in n for n in package.PLAN["notes"])
    runner = package.PipelineRunner(package.build_stages(model))
    with torch.no_grad():
        torch.testing.assert_close(runner.forward(*args), reference(*args),
                                   rtol=1e-12, atol=1e-12)
    target = torch.zeros(())

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean() + target

    loss = runner.step(args, target, loss_fn)
    want = loss_fn(reference(*args), target)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("example_batch", [2, T])  # T: dim 0 of x and of the mask agree
def test_causal_mask_is_shared_by_every_micro_batch(tmp_path: Path, schedule: str,
                                                    example_batch: int) -> None:
    torch.manual_seed(0)
    model = MaskedAttention().double()
    x = torch.randn(M * example_batch, T, D, dtype=torch.float64)
    example = (torch.randn(example_batch, T, D, dtype=torch.float64), causal_mask())
    _check(model, (x, causal_mask()), example, tmp_path / "pkg", schedule, ("mask",))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hf_position_ids_are_shared(tmp_path: Path, schedule: str) -> None:
    torch.manual_seed(0)
    model = Positions().double()
    ids = torch.randint(0, 11, (M * 2, T))
    positions = torch.arange(T).unsqueeze(0)
    example = (torch.randint(0, 11, (2, T)), positions)
    _check(model, (ids, positions), example, tmp_path / "pkg", schedule, ("position_ids",))


def test_batched_inputs_of_one_size_are_all_split() -> None:
    """A per-sample attention mask beside the tokens: both batched (one trial run)."""
    class TwoInputs(nn.Module):
        def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            return ids.double() * keep

    ids, keep = torch.ones(3, T), torch.ones(3, T)
    decision = decide_batching(TwoInputs(), (ids, keep), {})
    assert decision.batched == {id(ids), id(keep)}


def test_an_input_on_a_tower_of_its_own_is_batched() -> None:
    """Two inputs that never meet (a second tower, returned as an output of its own): the
    model runs whichever of them gets a bigger batch, but with only x resized the second
    output stays at the old batch size, which a per-sample output does not."""
    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)
            self.b = nn.Linear(5, 2)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.a(x), self.b(y)

    x, y = torch.randn(2, 4), torch.randn(2, 5)
    decision = decide_batching(Towers(), (x, y), {})
    assert decision.batched == {id(x), id(y)}
    assert decision.how == "traced with batch sizes 2 and 3"


def test_shared_inputs_may_outnumber_the_batched_one() -> None:
    """x first, then two shared tables of one size (a rotary embedding's cos and sin):
    their dim 0 is the most common, but only x's follows into every output."""
    class Rotary(nn.Module):
        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> torch.Tensor:
            return x * cos + x.flip(-1) * sin

    x, cos, sin = torch.randn(2, T, D), torch.randn(T, D), torch.randn(T, D)
    decision = decide_batching(Rotary(), (x, cos, sin), {})
    assert decision.batched == {id(x)}


def test_a_forward_that_makes_a_tensor_is_tried_on_fake_tensors() -> None:
    """torch.arange in forward makes a CPU tensor, which meta tensors cannot meet: the trial
    runs use fake CPU tensors instead of assuming every input of the batch size batched."""
    class Offset(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor
                    ) -> torch.Tensor:
            return x + y * mask + torch.arange(D, dtype=x.dtype)

    x, y, mask = torch.randn(2, 2, D), torch.randn(2, 2, D), torch.randn(2, D)
    decision = decide_batching(Offset(), (x, y, mask), {})
    assert decision.batched == {id(x), id(y)}


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keywords"])
def test_an_input_only_a_training_batch_norm_reads_is_batched(by_keyword: bool) -> None:
    """Nothing reads the batch norm's result, but its running statistics take in the rows
    of its input: they must be one micro-batch's, so the input is split. torch.batch_norm
    called with keywords is read as well (the trial runs once failed on it, and every
    input was then assumed batched)."""
    class Statistics(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 4)
            self.register_buffer("mean", torch.zeros(10))
            self.register_buffer("var", torch.ones(10))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if by_keyword:
                torch.batch_norm(input=y, weight=None, bias=None, running_mean=self.mean,
                                 running_var=self.var, training=True, momentum=0.1,
                                 eps=1e-5, cudnn_enabled=False)
            else:
                torch.nn.functional.batch_norm(y, self.mean, self.var, training=True)
            return self.a(x)

    x, y = torch.randn(3, 6), torch.randn(3, 10)
    decision = decide_batching(Statistics(), (x, y), {})
    assert decision.batched == {id(x), id(y)}
    assert decision.how == "traced with batch sizes 3 and 4"


def test_one_sample_cannot_tell_and_batch_dims_can() -> None:
    """With a batch of 1 a (1, T) input may be per sample or shared: fxpipe says so and
    names the fix; batch_dims() decides."""
    model = Positions()
    ids, positions = torch.randint(0, 11, (1, T)), torch.arange(T).unsqueeze(0)
    with pytest.raises(BatchDimsError, match=r"define batch_dims\(\).*at least 2 samples"):
        decide_batching(model, (ids, positions), {})
    decision = decide_batching(model, (ids, positions), {}, declared=(0, None))
    assert decision.batched == {id(ids)}
    with pytest.raises(BatchDimsError, match="one entry"):
        decide_batching(model, (ids, positions), {}, declared=(0,))
    with pytest.raises(BatchDimsError, match="dim 0 only"):
        decide_batching(model, (ids, positions), {}, declared=(1, None))


MODEL_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(11, 8)
        self.positions = nn.Embedding(4, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, input_ids, position_ids):
        return self.out(self.tokens(input_ids) + self.positions(position_ids))


def build_model():
    return Net()


def example_inputs():
    return torch.randint(0, 11, (1, 4)), torch.arange(4).unsqueeze(0)
'''


def test_model_file_batch_dims(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without batch_dims() the split stops with the fix; with it, plan.json says so."""
    from fxpipe import cli

    path = tmp_path / "model.py"
    path.write_text(MODEL_FILE, encoding="utf-8")
    split = ["split", str(path), "--gpus", "2", "--microbatches", "2"]
    assert cli.main([*split, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "define batch_dims()" in err[0], err
    assert not (tmp_path / "a").exists()

    path.write_text(MODEL_FILE + "\n\ndef batch_dims():\n    return (0, None)\n",
                    encoding="utf-8")
    assert cli.main([*split, "--out", str(tmp_path / "b")]) == 0
    plan = (tmp_path / "b" / "plan.json").read_text(encoding="utf-8")
    assert '"shared_inputs": [\n    "position_ids"\n  ]' in plan
    report = (tmp_path / "b" / "report.md").read_text(encoding="utf-8")
    assert "position_ids (declared by batch_dims())" in report
