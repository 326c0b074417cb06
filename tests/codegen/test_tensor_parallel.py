"""Which parameters a tensor-parallel package splits along which dim (the
``TENSOR_PARALLEL`` table of distributed.py), read off the graph's column / row pairs
and vocabulary ops, under both tracers; a tied parameter splits only as all its names do.
The runs that hold the table to the unsplit model's gradients are
tests/distributed/test_tensor_parallel_torchrun.py."""

from __future__ import annotations

import torch
from torch import nn

from fxpipe.codegen.stages import stage_io
from fxpipe.codegen.tensor_parallel import parameter_splits
from fxpipe.codegen.torchrun import tied_parameters
from fxpipe.frontend import Traced, trace
from fxpipe.passes import annotate_all
from tests.codegen._models import traced
from tests.codegen._plans import contiguous_plan


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
