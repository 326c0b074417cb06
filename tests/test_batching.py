"""fxpipe.batching by argument position: one tensor passed as two arguments (a language
model's tokens as their own targets, ``model(idx, idx)``) is two inputs, each decided and
named on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fxpipe.batching import BatchDimsError, decide_batching
from fxpipe.frontend import trace

VOCAB, T = 11, 16


class TokensAndTargets(nn.Module):
    """nanoGPT's signature: logits, and the loss where targets are given."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.embed(idx))
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


class Broadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + y


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.a(x) + table.sum(0)


@pytest.mark.parametrize("rows", [1, 2])
def test_one_tensor_as_tokens_and_targets_is_batched(rows: int) -> None:
    idx = torch.randint(0, VOCAB, (rows, T))
    decision = decide_batching(TokensAndTargets(), (idx, idx), {})
    assert decision.batched == {id(idx)}, decision
    traced = trace(TokensAndTargets(), (idx, idx))
    assert traced.batched == (True, True) and traced.shared_inputs == ()


def test_one_tensor_passed_twice_is_named_by_each_position() -> None:
    x = torch.randn(1, 8)
    with pytest.raises(BatchDimsError, match=r"argument 0 \(1, 8\), argument 1 \(1, 8\) have"):
        decide_batching(Broadcast(), (x, x), {})
    with pytest.raises(BatchDimsError, match=r"argument 0 \(1, 8\), 'y' \(1, 8\) have"):
        decide_batching(Broadcast(), (x,), {"y": x})


def test_one_tensor_batched_in_one_place_and_shared_in_another_is_refused() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(BatchDimsError, match=r"argument 0 and argument 1 are one tensor, but "
                       r"only argument 0 has a batch dimension: pass argument 1 a copy"):
        decide_batching(Table(), (x, x), {})
    with pytest.raises(BatchDimsError, match="are one tensor"):
        decide_batching(Table(), (x, x), {}, declared=(0, None))
    decision = decide_batching(Table(), (x, x.clone()), {})  # a copy of its own: decided
    assert decision.batched == {id(x)}


class PaddingMask(nn.Module):
    """Reads its padding mask where each sample's row is, at arange(batch), as Hugging
    Face's masks do: meta and fake tensors do not check that index against the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[0])[:, None]
        keep = mask[rows, torch.arange(x.shape[1])[None, :]]
        return self.a(x) * keep[..., None]


class SelectedRows(PaddingMask):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.a(x) * mask.index_select(0, torch.arange(x.shape[0]) + 0)[..., None]


@pytest.mark.parametrize("model", [PaddingMask, SelectedRows])
def test_an_input_read_at_arange_of_the_batch_is_batched(model: type[nn.Module]) -> None:
    """The mask was taken for one every sample shares: left at b rows beside an input of
    b + 1 the trial ran, its index past the mask's end unchecked."""
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5)
    decision = decide_batching(model(), (x, mask), {})
    assert decision.batched == {id(x), id(mask)}, decision


LLAMA_WITH_A_MASK = """
import sys
import torch
sys.path.insert(0, {examples!r})
from transformers_models import _make_llama as build_model


def example_inputs():
    ids = torch.randint(3, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    return {{"input_ids": ids, "attention_mask": torch.ones(2, 32, dtype=torch.long)}}
"""


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_hf_micro_batches_keep_each_samples_padding(tmp_path: Path, family: str) -> None:
    """HF BERT's and Llama's attention_mask went whole to every micro-batch, and each read
    the first micro-batch's rows of it: padded samples got another sample's mask,
    silently (Llama's logits 0.56 off with the last two samples left-padded)."""
    import fxpipe
    from fxpipe.frontend import load_model_file

    examples = Path(__file__).resolve().parents[1] / "examples"
    path = examples / "hf_bert.py"
    if family == "llama":
        path = tmp_path / "llama_mask.py"
        path.write_text(LLAMA_WITH_A_MASK.format(examples=str(examples)))
    plan = fxpipe.split_file(path, gpus=2, pp=2, microbatches=2, out=tmp_path / "pkg")
    assert plan.shared_inputs == ()
    model = load_model_file(str(path)).model.eval()
    ids = torch.randint(3, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[2:, :10] = 0  # the last two samples padded on the left
    inputs = {"input_ids": ids, "attention_mask": mask}
    if family == "bert":
        inputs["token_type_ids"] = torch.zeros_like(ids)
    package = fxpipe.load_package(tmp_path / "pkg")
    runner = package.PipelineRunner(package.build_stages(model))
    with torch.no_grad():
        want = model(**inputs).logits
        got = runner.forward(**inputs)
    torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)
