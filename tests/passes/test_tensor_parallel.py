"""Which ops shard how under tensor parallelism (fxpipe/passes/tensor_parallel.py): the
column / row-parallel pairs, the vocabulary-parallel embedding and head, and what stays
replicated, on a symbolic_trace GPT (fused qkv, tied head), a symbolic_trace Llama (GQA,
SwiGLU) and an exported transformers Llama (aten.linear with get_attr weights)."""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path

import pytest
import torch.fx

from fxpipe import meta
from fxpipe.compiler import analyze_file
from fxpipe.cost_models import get_device
from fxpipe.partition.tensor_parallel import REPLICATED
from fxpipe.passes.tensor_parallel import TensorParallel, annotate_tensor_parallel, shards

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@cache
def _found(example: str) -> tuple[torch.fx.GraphModule, TensorParallel]:
    _, traced = analyze_file(str(EXAMPLES / example), device=get_device("h100"))
    return traced.gm, annotate_tensor_parallel(traced.gm)


def _modules(gm: torch.fx.GraphModule, names: tuple[str, ...]) -> list[str]:
    nodes = {n.name: n for n in gm.graph.nodes}
    return [meta.MODULE.get(nodes[name]).path for name in names]


def test_gpt_pairs_its_fused_qkv_with_proj_and_fc_with_proj() -> None:
    gm, found = _found("gpt.py")
    pairs = [(_modules(gm, p.columns), _modules(gm, (p.row,))[0]) for p in found.pairs]
    assert pairs[:2] == [(["blocks.0.attn.qkv"], "blocks.0.attn.proj"),
                         (["blocks.0.mlp.fc"], "blocks.0.mlp.proj")]
    assert len(pairs) == 8  # 4 blocks, attention and MLP each
    attention, mlp = found.pairs[:2]
    assert (attention.heads, attention.kv_heads, attention.units) == (4, 4, 4)
    assert (mlp.heads, mlp.units) == (0, 512)  # the hidden width
    assert found.vocab == ("tok_emb", "lm_head")  # tied: both split by vocabulary rows
    # the position embedding is no vocabulary: it, the norms and the residual stay whole
    assert found.replicated == ("pos_emb", "blocks.*.ln_1", "blocks.*.ln_2", "ln_f")
    assert found.degrees(8) == [1, 2, 4]


def test_llama_pairs_q_k_v_with_o_and_gate_up_with_down_and_gqa_bounds_the_degree() -> None:
    gm, found = _found("llama.py")
    attention, mlp = found.pairs[:2]
    assert _modules(gm, attention.columns) == [
        "layers.0.attn.wq", "layers.0.attn.wk", "layers.0.attn.wv"]
    assert _modules(gm, (attention.row,)) == ["layers.0.attn.wo"]
    assert _modules(gm, mlp.columns) == ["layers.0.mlp.w1", "layers.0.mlp.w3"]
    assert _modules(gm, (mlp.row,)) == ["layers.0.mlp.w2"]
    assert (attention.heads, attention.kv_heads) == (4, 2)
    assert found.degrees(8) == [1, 2]  # 2 KV heads
    assert found.refusal(4) == "the 2 KV heads of layers.0.attn (4 query heads)"
    assert found.refusal(8) == "the 4 attention heads of layers.0.attn"
    assert found.refusal(2) is None
    assert found.replicated == ("layers.*.attn_norm", "layers.*.mlp_norm", "norm")
    # the rotary tables are side inputs of the pair, not split values; q times them is
    roles = {n.name: meta.SHARD.get(n).role for n in gm.graph.nodes if meta.SHARD.has(n)}
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["narrow"].args[0].target == "layers.0.attn.rotary.cos"
    assert (roles["narrow"], roles["to"], roles["mul_2"]) == ("replicated", "replicated",
                                                              "inside")
    assert all(roles[n.name] == "replicated" for n in gm.graph.nodes
               if n.op != "get_attr" and meta.SHARD.has(n)
               and meta.MODULE.get(n).path.endswith("norm"))


def test_an_exported_llama_pairs_its_aten_linears() -> None:
    gm, found = _found("hf_llama.py")
    assert {n.op for n in gm.graph.nodes if meta.SHARD.has(n)
            and meta.SHARD.get(n).role == "column"} == {"call_function"}
    attention, mlp = found.pairs[:2]
    assert attention.module == "model.layers.0.self_attn"
    assert [m.rpartition(".")[2] for m in _modules(gm, attention.columns)] == [
        "q_proj", "k_proj", "v_proj"]
    assert _modules(gm, (attention.row,))[0].endswith("o_proj")
    assert [m.rpartition(".")[2] for m in _modules(gm, mlp.columns)] == [
        "gate_proj", "up_proj"]
    assert (attention.heads, attention.kv_heads) == (4, 2)
    assert found.vocab == ("model.embed_tokens", "lm_head")
    assert "model.layers.*.input_layernorm" in found.replicated


@pytest.mark.parametrize("example", ["gpt.py", "llama.py", "hf_llama.py"])
def test_each_op_prices_as_its_role_says(example: str) -> None:
    gm, found = _found(example)
    ops = [n for n in gm.graph.nodes if meta.SHARD.has(n)]
    priced = dict(zip(ops, shards(ops), strict=True))
    roles = Counter(meta.SHARD.get(n).role for n in ops)
    assert roles["row"] == len(found.pairs)
    for node, shard in priced.items():
        role = meta.SHARD.get(node).role
        assert (shard == REPLICATED) == (role == "replicated"), node
        if role == "row":  # a pair's forward all-reduce: its output, whole
            assert shard.forward_reduce_bytes == meta.SHAPE.get(node).nbytes > 0
            assert not shard.values
    # one backward all-reduce per pair, on its first column
    reducing = [n for n, s in priced.items()
                if s.backward_reduce_bytes and meta.SHARD.get(n).role == "column"]
    assert len(reducing) == len(found.pairs)


def test_addmm_and_mm_with_a_weight_of_the_model_are_linears() -> None:
    from torch import nn

    from fxpipe.passes import annotate_all
    from fxpipe.passes.tensor_parallel import embedding_rows, linear_features

    class Exported(nn.Module):  # x @ w.t() + b, as torch.export writes a linear
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(24, 8))  # (out, in)
            self.b = nn.Parameter(torch.randn(24))
            self.v = nn.Parameter(torch.randn(24, 8))  # (in, out): x @ v
            self.table = nn.Parameter(torch.randn(50, 8))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = torch.nn.functional.embedding(ids, self.table)
            return torch.mm(torch.addmm(self.b, x[0], self.w.t()), self.v)

    gm = torch.fx.symbolic_trace(Exported())
    annotate_all(gm, torch.randint(0, 50, (1, 4)))
    found = {n.name: linear_features(gm, n) for n in gm.graph.nodes}
    assert found["addmm"] == (24, 8) and found["mm"] == (8, 24)
    assert {n.name: embedding_rows(gm, n) for n in gm.graph.nodes}["embedding"] == 50


@pytest.mark.parametrize("example", ["gpt.py", "hf_llama.py"])
def test_a_row_linears_bias_stays_whole(example: str) -> None:
    """A row linear's bias is added once to the all-reduced sum, so every GPU holds it
    whole (``whole_param_bytes``): GPT's projections (nn.Linear, 128 float32 each) have
    one, the exported Llama's o and down (aten.linear, no bias) none."""
    gm, _ = _found(example)
    ops = [n for n in gm.graph.nodes if meta.SHARD.has(n)]
    rows = [s for n, s in zip(ops, shards(ops, gm), strict=True)
            if meta.SHARD.get(n).role == "row"]
    assert rows and {s.whole_param_bytes for s in rows} == (
        {128 * 4} if example == "gpt.py" else {0})


def test_sequence_parallelism_runs_the_ops_per_token_between_the_pairs() -> None:
    """The GPT: every row's output enters one gap along the tokens (dim 1, 64 of them):
    the residual adds and the LayerNorms after the first attention; the norms the next
    columns or the LM head read are its exits, the embedding's sum its entry; the first
    block's ln_1 (before any row) is not in it. At a t that does not divide 64 no gap
    applies and every row keeps its all-reduce."""
    from fxpipe.passes.sequence_parallel import sequence_gaps

    gm, found = _found("gpt.py")
    sequence = sequence_gaps(gm)
    (gap,) = sequence.gaps
    assert set(gap.rows) == {p.row for p in found.pairs} and sequence.kept == ()
    assert (gap.dim, gap.tokens) == (1, 64)
    modules = _modules(gm, gap.ops)
    assert "blocks.0.ln_1" not in modules and "blocks.0.ln_2" in modules
    assert "ln_f" in modules and "blocks.3.ln_1" in modules
    assert _modules(gm, gap.exits) == [*[f"blocks.{i // 2}.ln_{i % 2 + 1}" for i in
                                         range(1, 8)], "ln_f"]
    assert len(gap.entries) == 1
    assert sequence.at(3) == () and sequence.kept_at(gm, 3) == ("blocks.*.attn.proj",
                                                                 "blocks.*.mlp.proj")


class _Mixing(torch.nn.Module):
    """A pair whose output meets an op that mixes positions (a running sum along the
    tokens): at once (``direct``), or after a residual add."""

    def __init__(self, direct: bool) -> None:
        super().__init__()
        self.direct = direct
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        return (y if self.direct else x + y).cumsum(1)


@pytest.mark.parametrize("direct", [True, False])
def test_an_op_mixing_positions_ends_a_gap_or_keeps_the_all_reduce(direct: bool) -> None:
    from fxpipe.frontend import trace
    from fxpipe.passes import annotate_all
    from fxpipe.passes.sequence_parallel import sequence_gaps

    found = trace(_Mixing(direct), (torch.randn(2, 8, 16),), {})
    annotate_all(found.gm, *found.flat_inputs)
    annotate_tensor_parallel(found.gm)
    sequence = sequence_gaps(found.gm)
    if direct:  # nothing per token between: the row keeps its all-reduce
        assert sequence.gaps == () and sequence.kept == ("down",)
        return
    (gap,) = sequence.gaps
    assert (gap.rows, gap.ops, gap.exits, gap.entries) == (("down",), ("add",), ("add",),
                                                           ("x",))
