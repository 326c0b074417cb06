"""Tensor parallelism under torchrun: ``fxpipe split --pp 2 --tp 2`` plans each of 2
pipeline stages split over 2 GPUs of a host, and its train_torchrun.py runs them on 4
ranks, a ("dp", "pp", "tp") DeviceMesh, each stage's parameters torch DTensors split as
the plan's TENSOR_PARALLEL table says. One step gives every parameter the unsplit model's
gradient (float64, to 1e-12 of the largest; DTensor gradients gathered whole), and each
rank holds only its shard of every split parameter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Shard

from fxpipe import cli

from . import dropout_mlp, gpt64, hf_gpt2_64, llama64, renorm_mlp, t5_64_tp
from ._helpers import assert_model_grads, import_package, load, torchrun

GPT64 = Path(gpt64.__file__)  # examples/gpt.py in float64: its LM head tied to tok_emb
HF_GPT2_64 = Path(hf_gpt2_64.__file__)  # HF GPT-2: tied head, Conv1D as addmm on (in, out)
LLAMA64 = Path(llama64.__file__)  # HF Llama, grouped-query attention (4 heads, 2 KV heads)
T5_TP = Path(t5_64_tp.__file__)  # HF T5: encoder-decoder, one embedding read three times
TOLERANCE = 1e-12  # of the largest gradient
M = 4  # micro-batches a step


def _run(tmp_path: Path, model: Path, *flags: str, gpus: int = 4, steps: int = 1
         ) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """Split ``model`` with ``flags``, train ``steps`` steps (Adam) on a random global
    batch under torchrun: (the package's distributed module, the batch, each rank's save
    of the last step)."""
    out = tmp_path / "pkg"
    assert cli.main(["split", str(model), "--gpus", str(gpus), "--microbatches", str(M),
                     *flags, "--out", str(out), "--force"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    source, _ = load(str(model))
    rows = plan["layout"]["global_batch"]
    generator = torch.Generator().manual_seed(0)
    ids = lambda t: torch.randint(3, 1000, (rows, *t.shape[1:]), generator=generator)  # noqa: E731
    batch = {"args": tuple(ids(a) for a in source.args),
             "kwargs": {k: ids(v) for k, v in source.kwargs.items()},
             "target": ids(source.target)}
    torch.save(batch, tmp_path / "batch.pt")
    result = torchrun(gpus, out / "train_torchrun.py", "--model", str(model), "--batch",
                      str(tmp_path / "batch.pt"), "--save", str(tmp_path / "out"),
                      "--optimizer", "adam", "--steps", str(steps))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    saves = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False)
             for r in range(gpus)]
    return import_package(out, f"tp_{tmp_path.name}").distributed, batch, saves


def _one_split_stage(tmp_path: Path, model: Path, script: str) -> Path:
    """``model`` split into one stage over 2 ranks (pp 1 x tp 2, 2 micro-batches) in
    ``tmp_path``/pkg, and ``script`` of this folder (PACKAGE MODEL OUT) run on it under
    torchrun: OUT, where each rank wrote."""
    out = tmp_path / "pkg"
    assert cli.main(["split", str(model), "--gpus", "2", "--pp", "1", "--tp", "2",
                     "--microbatches", "2", "--out", str(out)]) == 0
    written = tmp_path / "ranks"
    result = torchrun(2, Path(__file__).with_name(script), str(out), str(model), str(written))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return written


def _unsplit(model: Path, batch: dict[str, Any], steps: int
             ) -> tuple[float, dict[str, torch.Tensor], dict[str, int]]:
    """The unsplit model's loss and gradients in its ``steps``-th step (Adam between, as
    train_torchrun steps it), and which parameter each name is (a tied one has several
    names)."""
    source, _ = load(str(model))
    optimizer = torch.optim.Adam(source.model.parameters(), lr=1e-3)
    for step in range(steps):
        if step:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = source.loss_fn(source.model(*batch["args"], **batch["kwargs"]),
                              batch["target"])
        loss.backward()
    named = list(source.model.named_parameters(remove_duplicate=False))
    return (float(loss.detach()), {name: p.grad for name, p in named},
            {name: id(p) for name, p in named})


def _assert_exact(model: Path, batch: dict[str, Any], saves: list[dict[str, Any]],
                  last_ranks: int = 2, steps: int = 1) -> None:
    """Every rank's gradients (gathered whole) are the unsplit model's in the same step,
    the ranks hold every parameter between them, and the last stage's ranks report its
    loss."""
    loss, expected, which = _unsplit(model, batch, steps)
    assert_model_grads(saves, expected, TOLERANCE, which)
    for rank, save in enumerate(saves):
        if save["loss"] is not None:
            assert abs(float(save["loss"]) - loss) <= TOLERANCE * loss, (rank, loss)
    assert sum(save["loss"] is not None for save in saves) == last_ranks  # the last stage's


def _assert_split_bytes(distributed: Any, model: Path, saves: list[dict[str, Any]],
                        tp: int = 2) -> None:
    """Each rank holds 1/tp of every parameter TENSOR_PARALLEL splits, the rest whole, and
    Adam's two moments of it."""
    degree, splits = distributed.TENSOR_PARALLEL
    assert degree == tp and all(splits)
    params = dict(load(str(model))[0].model.named_parameters(remove_duplicate=False))
    pp = len(splits)
    for rank, save in enumerate(saves):
        k = rank // tp % pp
        # the stage's parameters, each once (a tied one under its first name)
        names = {id(params[n]): n for n in sorted(save["grads"], reverse=True)}.values()
        held = sum(params[n].numel() * params[n].element_size() // (tp if n in splits[k] else 1)
                   for n in names)
        assert save["memory"]["params_local"] == held, (rank, save["memory"], held)
        assert save["memory"]["optimizer"] == 2 * held, (rank, save["memory"], held)


def test_gpt_pp2_tp2_gives_the_unsplit_gradients_and_splits_its_parameters(
        tmp_path: Path) -> None:
    """4 ranks, 2 stages x 2: the GPT's pairs split Megatron-LM's way, the ops between
    them on each GPU's half of the tokens (sequence parallelism; the residual stream
    crosses the stage boundary whole), and its embedding and tied LM head by vocabulary
    rows, on different pipeline stages: the tied gradient is summed shard by shard, and
    the loss is a vocabulary-parallel cross-entropy. Two steps:
    after Adam steps each rank's shards, the second step's gradients are still the
    unsplit model's."""
    distributed, batch, saves = _run(tmp_path, GPT64, "--pp", "2", "--tp", "2", steps=2)
    splits = distributed.TENSOR_PARALLEL[1]
    assert splits[0]["tok_emb.weight"] == splits[1]["lm_head.weight"] == 0
    assert distributed.TIED == ({0: "tok_emb.weight", 1: "lm_head.weight"},)
    _assert_exact(GPT64, batch, saves, steps=2)
    _assert_split_bytes(distributed, GPT64, saves)
    for save in saves[2:]:  # the loss read each rank's half of the logits, never gathered
        (logits, *_) = save["outputs"]
        assert logits.placements == (Shard(2),) and logits.to_local().shape == (2, 64, 500)


@pytest.mark.slow
def test_hf_llama_with_grouped_query_attention_pp2_tp2(tmp_path: Path) -> None:
    """torch.export's graph of a Hugging Face Llama (4 query heads, 2 KV heads: each rank
    one KV head, repeated for its 2 query heads), its LM head split by vocabulary rows."""
    distributed, batch, saves = _run(tmp_path, LLAMA64, "--pp", "2", "--tp", "2")
    assert distributed.TENSOR_PARALLEL[1][1]["lm_head.weight"] == 0
    _assert_exact(LLAMA64, batch, saves)
    _assert_split_bytes(distributed, LLAMA64, saves)


@pytest.mark.slow
def test_hf_t5_encoder_decoder_pp2_tp2(tmp_path: Path) -> None:
    """torch.export's graph of a Hugging Face T5: an encoder and a decoder with
    cross-attention and relative position biases split by heads, its norms on each
    rank's tokens, and one embedding read by the encoder, the decoder and the LM head."""
    _, batch, saves = _run(tmp_path, T5_TP, "--pp", "2", "--tp", "2")
    _assert_exact(T5_TP, batch, saves)


@pytest.mark.slow
def test_hf_gpt2_with_a_tied_vocabulary_parallel_head_pp2_tp2(tmp_path: Path) -> None:
    """torch.export's graph of a Hugging Face GPT-2: its Conv1D weights, (in, out), split
    along dim 1 where a column-parallel linear's split along 0 (the fused c_attn by its
    q, k and v, each rank taking its heads of each); its token embedding and
    the LM head that shares its table split by vocabulary rows on both stages."""
    distributed, batch, saves = _run(tmp_path, HF_GPT2_64, "--pp", "2", "--tp", "2")
    stage0, stage1 = distributed.TENSOR_PARALLEL[1]
    # the fused c_attn: each rank's share of q, k and v (its heads of each)
    assert stage0["transformer.h.0.attn.c_attn.weight"] == (1, (64, 64, 64))
    assert stage0["transformer.h.0.attn.c_proj.weight"] == 0
    assert stage0["lm_head.weight"] == stage1["lm_head.weight"] == 0
    _assert_exact(HF_GPT2_64, batch, saves)
    _assert_split_bytes(distributed, HF_GPT2_64, saves)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [("--schedule", "zb1p"),
                                      ("--schedule", "interleaved", "--virtual-stages", "2"),
                                      ("--schedule", "zbv", "--virtual-stages", "2")],
                         ids=["zb1p", "interleaved", "zbv"])
def test_gpt_pp2_tp2_under_other_schedules(tmp_path: Path, schedule: tuple[str, ...]) -> None:
    """torch's zero-bubble class (the backward in two passes, the loss detached in place),
    interleaved 1F1B and the V (4 stages on 2 ranks of 2 GPUs; under zbv the first and
    last stages, the embedding and its tied head, share a rank): the unsplit gradients."""
    _, batch, saves = _run(tmp_path, GPT64, "--pp", "2", "--tp", "2", *schedule)
    _assert_exact(GPT64, batch, saves)


@pytest.mark.slow
@pytest.mark.parametrize("model", [GPT64, LLAMA64], ids=["gpt", "llama_gqa"])
def test_pp2_tp2_dp2_on_8_ranks_with_fsdp(tmp_path: Path, model: Path) -> None:
    """8 ranks: 2 pipelines, each of 2 stages split over 2 GPUs (the ops between the pairs
    on each GPU's half of the tokens), each stage's 2 copies sharded by FSDP2 over the dp
    sub-mesh of the same 3-D mesh: the unsplit model's gradients on the global batch."""
    _, batch, saves = _run(tmp_path, model, "--pp", "2", "--tp", "2", "--dp-mode", "fsdp",
                           gpus=8)
    _assert_exact(model, batch, saves, last_ranks=4)


def test_ddp_pipelines_of_split_stages_are_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch's DDP takes no DTensor parameters: fxpipe split refuses pp 2 x tp 2 x dp 2
    under ddp before tracing (it planned it, and only the package refused), and the
    search under ddp plans split stages only as one pipeline."""
    out = tmp_path / "pkg"
    flags = ["split", str(GPT64), "--gpus", "8", "--pp", "2", "--tp", "2", "--out", str(out)]
    assert cli.main([*flags, "--dp-mode", "ddp"]) == 2
    assert capsys.readouterr().err.strip() == (
        "fxpipe: error: --dp-mode ddp cannot keep copies of stages split over GPUs (--tp 2): "
        "torch's DDP takes no DTensor parameters; use --dp-mode fsdp, or --pp 4 for one "
        "pipeline of all the GPUs")
    assert not out.exists()
    assert cli.main(["split", str(GPT64), "--gpus", "8", "--tp", "2", "--pp", "auto",
                     "--out", str(tmp_path / "auto"), "--dp-mode", "ddp"]) == 0
    layout = json.loads((tmp_path / "auto" / "plan.json").read_text())["layout"]
    assert all(row["dp"] == 1 for row in layout["considered"] if row.get("tp", 1) > 1)


@pytest.mark.slow
def test_an_op_dtensor_cannot_split_is_refused_in_one_line(tmp_path: Path) -> None:
    """A stage running an op torch's DTensor has no rule for (renorm): every rank says
    which op, in one line, and no rank prints a traceback."""
    model = Path(renorm_mlp.__file__)
    out = tmp_path / "pkg"
    assert cli.main(["split", str(model), "--gpus", "2", "--pp", "1", "--tp", "2",
                     "--microbatches", "2", "--out", str(out)]) == 0
    result = torchrun(2, out / "train_torchrun.py", "--model", str(model))
    output = (result.stdout + result.stderr).splitlines()
    assert result.returncode != 0
    assert not any(line.startswith("[rank") for line in output), output  # a traceback
    why = ("torch's DTensor has no sharding rule for aten.renorm.default, which this stage "
           "runs: tensor parallelism cannot split it; split again with --tp 1")
    assert sorted(line for line in output if line.startswith("train_torchrun: error:")) == [
        f"train_torchrun: error: rank {rank}: {why}" for rank in (0, 1)]


@pytest.mark.parametrize("model", [
    GPT64, pytest.param(LLAMA64, marks=pytest.mark.slow)], ids=["gpt", "llama_gqa"])
def test_attention_and_the_mlp_run_on_each_ranks_share(tmp_path: Path, model: Path) -> None:
    """One forward of the model split over 2 ranks (pp 1 x tp 2), under torch's
    CommDebugMode: where each pair's all-reduce was (attention's and the MLP's in each
    block), a reduce-scatter along the tokens where the row linear makes its partial sums
    and an all-gather where the residual stream, on each rank's half of the tokens in
    between (sequence parallelism), is read by the next columns or the LM head; and the
    embedding's one collective (the GPT's table split by vocabulary rows: an all-reduce;
    the Llama's by width: an all-gather); no other collective (a fused qkv run on global
    DTensors is gathered at its split; a residual stream left split by width is gathered
    at every norm). The first column's local share is half its width; the logits are the
    unsplit model's."""
    counts = _one_split_stage(tmp_path, model, "comm_counts.py")
    built = load(str(model))[0].model
    if model == GPT64:  # a fused qkv of 4 heads x 32; the tied embedding split by rows
        layers, width = built.cfg.n_layer, 3 * 128
        want = {"all_reduce": 1, "reduce_scatter_tensor": 2 * layers,
                "all_gather_into_tensor": 2 * layers}
    else:  # q of 4 heads x 16 (k and v: 2 KV heads); the embedding split by width
        layers, width = built.config.num_hidden_layers, 4 * 16
        want = {"reduce_scatter_tensor": 2 * layers, "all_gather_into_tensor": 2 * layers + 1}
    for rank in range(2):
        found = json.loads((counts / f"rank{rank}.json").read_text())
        assert found["counts"] == want, found
        assert found["first_share"][-1] == width // 2
        assert found["error"] <= TOLERANCE


def test_a_dropout_on_a_share_draws_each_ranks_own_mask_and_on_whole_values_one(
        tmp_path: Path) -> None:
    """One training forward of a block split over 2 ranks (pp 1 x tp 2), each rank seeded
    its own way first: the dropout between the pair's linears (on each rank's half of
    the hidden width) and the one on the residual stream after the row (on each rank's
    half of the tokens) draw a different mask on each rank, as the unsplit model's
    differs from column to column and from token to token; the dropout on the input
    (whole on every rank) the same mask, so the copies stay equal; all drop about half."""
    written = _one_split_stage(tmp_path, Path(dropout_mlp.__file__), "dropout_masks.py")
    masks = [torch.load(written / f"rank{r}.pt") for r in range(2)]
    pre, inner, outer = ([m[key] for m in masks] for key in ("pre", "inner", "outer"))
    assert pre[0].shape == (2, 16, 32) and torch.equal(pre[0], pre[1])
    assert inner[0].shape == inner[1].shape == (2, 16, 32)  # each rank's half of 64
    assert not torch.equal(inner[0], inner[1])
    assert outer[0].shape == outer[1].shape == (2, 8, 32)  # each rank's half of 16 tokens
    assert not torch.equal(outer[0], outer[1])
    for mask in (*pre, *inner, *outer):
        assert 0.35 < float(mask.double().mean()) < 0.65


@pytest.mark.slow
@pytest.mark.parametrize("model", [GPT64, LLAMA64], ids=["gpt", "llama_gqa"])
def test_the_plan_keeps_what_autograd_keeps_on_each_rank(tmp_path: Path, model: Path) -> None:
    """A stage split over 2 ranks (pp 1 x tp 2, the ops between the pairs on each rank's
    half of the tokens): the bytes autograd keeps on each rank in a forward are the
    plan's activations of one micro-batch, within 0.5 % (the values the next columns
    read gathered and kept whole, the ops per token's own halved)."""
    written = _one_split_stage(tmp_path, model, "saved_bytes_tp.py")
    plan = json.loads((tmp_path / "pkg" / "plan.json").read_text())
    planned = plan["stages"][0]["memory"]["activations"]
    for rank in range(2):
        saved = json.loads((written / f"rank{rank}.json").read_text())["saved"]
        assert abs(saved - planned) <= 0.005 * planned, (rank, saved, planned)
