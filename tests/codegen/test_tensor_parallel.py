"""Which parameters a tensor-parallel package splits along which dim (the
``TENSOR_PARALLEL`` table of distributed.py), read off the graph's column / row pairs
and vocabulary ops, under both tracers; a tied parameter splits only as all its names do;
which pairs a stage runs on local shares, and the local sizes it writes for them.
The runs that hold the table to the unsplit model's gradients are
tests/distributed/test_tensor_parallel_torchrun.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fxpipe import cli
from fxpipe.codegen import load_package
from fxpipe.codegen.stages import stage_io
from fxpipe.codegen.tensor_parallel import parameter_splits, stage_local_pairs
from fxpipe.codegen.torchrun import tied_parameters
from fxpipe.frontend import Traced, load_model_file, trace
from fxpipe.passes import annotate_all
from tests.codegen._models import ruff, traced
from tests.codegen._plans import contiguous_plan

DISTRIBUTED = Path(__file__).resolve().parents[1] / "distributed"
GPT64 = DISTRIBUTED / "gpt64.py"  # examples/gpt.py in float64: a fused qkv
LLAMA64 = DISTRIBUTED / "llama64.py"  # an exported HF Llama: 4 heads, 2 KV heads


def _splits(traced_model: Traced, stages: int = 2) -> list[dict[str, int]]:
    gm = traced_model.gm
    annotate_all(gm, *traced_model.flat_inputs)  # as the compiler does: shapes, modules
    ios = stage_io(gm.graph, contiguous_plan(gm.graph, stages))
    return parameter_splits(gm, ios, tied_parameters(gm, ios))


def test_gpt_splits_its_pairs_and_its_tied_vocabulary() -> None:
    """symbolic_trace: qkv and fc by rows (their bias too), the projections by columns
    (their bias whole), the tied embedding and LM head both by vocabulary rows."""
    splits = _splits(traced("gpt")[1])
    found = {name: dim for split in splits for name, dim in split.items()}
    for block in range(4):
        p = f"blocks.{block}."
        assert {k[len(p):]: v for k, v in found.items() if k.startswith(p)} == {
            "attn.qkv.weight": 0, "attn.qkv.bias": 0, "attn.proj.weight": 1,
            "mlp.fc.weight": 0, "mlp.fc.bias": 0, "mlp.proj.weight": 1}
    assert found["tok_emb.weight"] == found["lm_head.weight"] == 0
    assert "tok_emb.weight" in splits[0] and "lm_head.weight" in splits[1]
    assert not {"pos_emb.weight", "ln_f.weight", "blocks.0.ln_1.weight"} & set(found)


def test_exported_llama_splits_its_pairs_and_its_untied_vocabulary() -> None:
    """torch.export (aten.linear on get_attr weights): q, k, v, gate and up by rows, o and
    down by columns, the LM head by vocabulary rows; the embedding, whose lookups two ops
    read (the residual and the norm), by width; norms whole."""
    found = {name: dim for split in _splits(traced("hf_llama")[1])
             for name, dim in split.items()}
    layer = {k.removeprefix("model.layers.0."): v for k, v in found.items()
             if k.startswith("model.layers.0.")}
    assert layer == {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0,
                     "self_attn.v_proj.weight": 0, "self_attn.o_proj.weight": 1,
                     "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0,
                     "mlp.down_proj.weight": 1}
    assert found["lm_head.weight"] == 0 and found["model.embed_tokens.weight"] == 1


class _TiedTwice(nn.Module):
    """An embedding read twice whose table is also the LM head's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(x)


def test_a_tied_parameter_split_two_ways_stays_whole() -> None:
    """The embedding splits by width (two readers), the head by rows: the one table they
    share cannot be both, so it stays whole; the MLP pair still splits."""
    model = _TiedTwice()
    found = {name: dim for split in _splits(trace(model, (torch.randint(0, 64, (2, 8)),), {}))
             for name, dim in split.items()}
    assert found == {"up.weight": 0, "up.bias": 0, "down.weight": 1}


class _Mlp(nn.Module):
    """A pair with an op between whose split dim the codegen follows (relu), or one it
    does not (a LayerNorm over the split width, whose statistics need the whole width)."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.mid: nn.Module = nn.LayerNorm(32) if norm else nn.ReLU()
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.mid(self.up(x)))


@pytest.mark.parametrize("norm", [False, True])
def test_a_pair_runs_on_local_shares_only_where_its_ops_split(norm: bool) -> None:
    """relu between: the pair runs on each rank's share (the row reads its share back
    along the last dim); a LayerNorm between: the pair stays on global DTensors (its
    weights still split), as a pair the codegen cannot follow must."""
    found = trace(_Mlp(norm), (torch.randn(2, 4, 16),), {})
    gm = found.gm
    annotate_all(gm, *found.flat_inputs)
    ios = stage_io(gm.graph, contiguous_plan(gm.graph, 1))
    (local,) = stage_local_pairs(gm, ios, tied_parameters(gm, ios), 2)
    pairs = list(local.pairs)
    (split,) = parameter_splits(gm, ios, tied_parameters(gm, ios))
    assert split == {"up.weight": 0, "up.bias": 0, "down.weight": 1}
    if norm:
        assert pairs == []
        return
    (pair,) = pairs
    assert (pair.columns, pair.row, pair.joined[1], pair.fused) == (("up",), "down", 2, {})


@pytest.mark.parametrize(("model", "lines"), [
    (GPT64, ["local_4 = 4 // tp", "local_128 = 128 // tp", ".split(local_128, dim=2)",
             ".view(size_1, size_2, local_4, 32)", "reshape(size_1, size_2, local_128)",
             "blocks_0_attn_proj_sum = tp_tokens(blocks_0_attn_proj, 1)",
             "blocks_0_ln_2_whole = tp_replicated(blocks_0_ln_2)",
             "add_1 = add_tokens + blocks_0_attn_proj_sum  # float64[2, 64 / tp, 128]"]),
    (LLAMA64, ["local_2 = 2 // tp", "[sym_size_int_12, local_2, 2, sym_size_int_13, 16]",
               "[sym_size_int_12, local_4, sym_size_int_13, 16]",
               "embedding_gathered = tp_replicated(embedding)",
               "embedding_tokens = tp_tokens(embedding_gathered, 1)"]),
], ids=["gpt", "llama_gqa"])
def test_a_stage_written_for_two_gpus_writes_local_sizes_and_runs_whole_at_one(
        tmp_path: Path, model: Path, lines: list[str]) -> None:
    """A pp 1 x tp 2 package's stage writes its head counts and split sizes as shares of
    tp (a fused qkv's split, the heads of a view, GQA's KV heads in its expand),
    reduce-scatters a row's partial sums along the tokens where it makes them, runs the
    ops between on its tokens (the residual stream from the embedding cut to them) and
    gathers them for the next columns, gathers an embedding split by width where it is
    looked up, and run in one process, where tp is 1, it is the model: the unsplit
    logits exactly."""
    out = tmp_path / "pkg"
    assert cli.main(["split", str(model), "--gpus", "2", "--pp", "1", "--tp", "2",
                     "--microbatches", "2", "--out", str(out)]) == 0
    source = (out / "stage0.py").read_text()
    for line in lines:
        assert line in source, line
    assert "tp_share(" in source and "tp_joined(" in source
    assert ruff(out) == ""
    package = load_package(out)
    model_source = load_model_file(str(model))
    stage = package.stage0.Stage0(model_source.model)
    assert stage.tp == 1 and stage.tp_mesh is None
    with torch.no_grad():
        given = {**dict(zip(stage.INPUTS, model_source.args, strict=False)),
                 **model_source.kwargs}
        (got,) = stage(**{name: given[name] for name in stage.INPUTS})
        want = model_source.model(*model_source.args, **model_source.kwargs)
    want = getattr(want, "logits", want)
    assert torch.equal(got, want)


def test_a_package_names_the_pairs_that_run_whole(tmp_path: Path) -> None:
    """A pair with an op the stage code cannot split on local shares (renorm) runs on
    global-shape DTensors, whole on every GPU though the plan divides it: distributed.py
    says which, and its stage has no local code; a package whose pairs all split says
    nothing of the kind."""
    for model, whole in ((DISTRIBUTED / "renorm_mlp.py", True), (GPT64, False)):
        out = tmp_path / model.stem
        assert cli.main(["split", str(model), "--gpus", "2", "--pp", "1", "--tp", "2",
                         "--microbatches", "2", "--out", str(out)]) == 0
        distributed = (out / "distributed.py").read_text()
        assert ("# pairs run whole on every GPU" in distributed) == whole
        assert ("tp_share(" in (out / "stage0.py").read_text()) != whole
        # and the plan's notes say so, with report.md: its prediction is not what runs
        notes = json.loads((out / "plan.json").read_text())["notes"]
        said = [note for note in notes if "tensor-parallel pairs run whole" in note]
        assert bool(said) == whole, notes
        if whole:
            assert "\n# down\n" in distributed
            assert said[0].startswith("1 of 1 tensor-parallel pairs run whole on each of the 2")
            assert "(down)" not in said[0] and ": down)" in said[0]
            assert said[0] in (out / "report.md").read_text().replace("\n", " ")


class _Attention(nn.Module):
    """Attention with a dropout on its probabilities (torch's ``dropout_p``), and one on
    its output after the row, on the residual stream."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        q, k, v = self.qkv(x).split(16, dim=2)
        q, k, v = (q.view(b, s, 2, 8).transpose(1, 2), k.view(b, s, 2, 8).transpose(1, 2),
                   v.view(b, s, 2, 8).transpose(1, 2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
        return x + self.drop(self.proj(y.transpose(1, 2).reshape(b, s, 16)))


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_a_pair_draws_its_own_random_numbers_where_it_drops(p: float) -> None:
    """The ops of a pair that draw random numbers (attention with a dropout) are the
    pair's ``random``: its stage code runs them on each rank's own state; attention
    without one draws nothing, and the dropout after the row (on values whole on every
    rank) is not the pair's."""
    found = trace(_Attention(p), (torch.randn(2, 4, 16),), {})
    assert found.tracer == "symbolic_trace"
    gm = found.gm
    annotate_all(gm, *found.flat_inputs)
    ios = stage_io(gm.graph, contiguous_plan(gm.graph, 1))
    ((pair,),) = (stage.pairs for stage in stage_local_pairs(gm, ios, tied_parameters(gm, ios),
                                                            2))
    attention = [n.name for n in gm.graph.nodes
                 if "scaled_dot_product" in str(n.target)]
    assert pair.random == (tuple(attention) if p else ())
    drop = next(n.name for n in gm.graph.nodes if n.target == "drop")
    assert drop not in pair.inside
