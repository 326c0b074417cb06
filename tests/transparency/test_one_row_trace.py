"""A model traced with an example of one row trains at any number of rows.

Traced at one row, a value without a batch dimension (HF Llama's rotary table, (1, T, D))
has dim 0 of the batch size too. A stage that receives a batch count recomputes it from
a value it receives with the batch as dim 0 (codegen/batch_sizes.py); reading it off the
table gave 1 whatever the rows, and the next ``expand`` failed, or a ``view`` folded the
rows into the heads. The pipeline must equal the unsplit model at any rows and sequence
length: outputs, loss and every gradient, in float64.
"""

from __future__ import annotations

import copy
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fxpipe.frontend import Traced, trace
from fxpipe.passes import annotate_all
from tests.codegen._models import grads, import_package, write_package
from tests.codegen._plans import contiguous_plan

from ._compile import compile_package

VOCAB, T = 61, 16  # vocabulary, traced sequence length
M = 2  # micro-batches


def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4 * T,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().train()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, types.ModuleType]:
    model = tiny_llama()
    example = torch.randint(0, VOCAB, (1, T))
    _, package = compile_package(model, (example,), tmp_path_factory.mktemp("llama"),
                                 gpus=2, microbatches=M)
    return model, package


def token_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = output["logits"]
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def assert_transparent(model: nn.Module, package: types.ModuleType, args: tuple[Any, ...],
                       target: Any, loss_fn: Any, **runner_kwargs: Any) -> None:
    """The runner's forward, loss and every gradient equal the unsplit model's."""
    reference = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    runner = package.PipelineRunner(package.build_stages(model), **runner_kwargs)
    with torch.no_grad():
        got = runner.forward(*args)
    want = reference(*args)
    for name in ("logits",) if isinstance(got, dict) else ():
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)
    if not isinstance(got, dict):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    loss = runner.step(args, target, loss_fn)
    want_loss = loss_fn(want, target)
    want_loss.backward()
    torch.testing.assert_close(torch.as_tensor(loss), want_loss.detach(), rtol=1e-10,
                               atol=1e-12)
    got_grads, want_grads = grads(model), grads(reference)
    assert sorted(got_grads) == sorted(want_grads)
    for name, value in want_grads.items():
        torch.testing.assert_close(got_grads[name], value, rtol=1e-9, atol=1e-12,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_the_llama_stages_count_rows_from_batched_values(
        llama: tuple[nn.Module, types.ModuleType]) -> None:
    _, package = llama
    folder = Path(package.__file__).parent
    counted = 0
    for path in sorted(folder.glob("stage*.py")):
        stage = getattr(package, path.stem)
        unbatched = set(getattr(getattr(stage, f"Stage{path.stem[5:]}"), "UNBATCHED", ()))
        for line in path.read_text().splitlines():
            if line.endswith("# this stage's own rows"):
                source = line.split("=")[1].split(".size(0)")[0].split()[-1]
                assert source not in unbatched, line
                counted += 1
    assert counted, "the cut no longer sends a batch count: the test checks nothing"


@pytest.mark.parametrize(("rows", "length"), [
    (1, T), (2, T), (3, T), (6, T), (3, T // 2), (6, T // 4), (1, T // 4)])
def test_llama_traced_at_one_row_trains_at_any_rows(
        llama: tuple[nn.Module, types.ModuleType], rows: int, length: int) -> None:
    model, package = llama
    g = torch.Generator().manual_seed(rows * 100 + length)
    ids = torch.randint(0, VOCAB, (rows * M, length), generator=g)
    labels = torch.randint(0, VOCAB, (rows * M, length), generator=g)
    assert_transparent(model, package, (ids,), labels, token_loss)


@pytest.mark.parametrize("replicas", [(1, 2), (2, 1)])
def test_llama_traced_at_one_row_trains_on_replicas(
        llama: tuple[nn.Module, types.ModuleType], replicas: tuple[int, int]) -> None:
    """A replica runs on a share of the micro-batch: the count it reads is its own."""
    model, package = llama
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (3 * M, T // 2), generator=g)
    labels = torch.randint(0, VOCAB, (3 * M, T // 2), generator=g)
    assert_transparent(model, package, (ids,), labels, token_loss, replicas=replicas)


class RowTable(nn.Module):
    """A (1, T, D) position table added to (B, T, D) activations, and a view by the
    batch count: symbolically traced, the count and the table cross to the next stage."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(T, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, length = x.size(0), x.size(1)
        table = self.positions(torch.arange(length).unsqueeze(0))  # (1, T, D)
        h = torch.tanh(self.a(x)) * 2.0
        h = (h + table).view(rows, length, 2, 4).transpose(1, 2)
        return self.b(h.reshape(rows, -1, 8) + table)


def _symbolic_package(tmp: Path) -> tuple[nn.Module, Traced, types.ModuleType]:
    torch.manual_seed(0)
    model = RowTable().double()
    traced = trace(model, (torch.randn(1, T, 8, dtype=torch.float64),))
    assert traced.tracer == "symbolic_trace"
    annotate_all(traced.gm, *traced.flat_inputs)  # as the compiler does: counts need shapes
    ops = [n.name for n in traced.gm.graph.nodes
           if n.op not in ("placeholder", "output", "get_attr")]
    # stage 1 begins at the add: it receives the counts, the table and h
    plan = contiguous_plan(traced.gm.graph, 2, starts=(0, ops.index("add")))
    write_package(tmp, traced, plan)
    return model, traced, import_package(tmp)


def test_a_symbolic_trace_at_one_row_counts_rows_from_a_batched_value(tmp_path: Path) -> None:
    model, _, package = _symbolic_package(tmp_path / "pkg")
    text = (tmp_path / "pkg" / "stage1.py").read_text()
    assert "        size = mul.size(0)  # this stage's own rows\n" in text, text
    assert 'UNBATCHED = ("positions",)' in text, text
    for rows, length in [(1, T), (3, T), (2, T // 2)]:
        x = torch.randn(rows * M, length, 8, dtype=torch.float64)
        assert_transparent(model, package, (x,), None, lambda out, _: out.square().mean())
        assert_transparent(model, package, (x,), None, lambda out, _: out.square().mean(),
                           replicas=(1, 2) if rows > 1 else (1, 1))
