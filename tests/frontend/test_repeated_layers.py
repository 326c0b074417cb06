"""Exporting two (or three, or two periods of) layers of a long list of identical layers
and copying the last (fxpipe.tracing.repeats) gives the graph a whole export gives, or
is not done.

The copy is compared with a whole export node by node (op, arguments by position,
parameters by name, module stack), and run against the model itself. Layers that
alternate (Gemma-2's and GPT-OSS's sliding-window and full attention) are copied in
turn. Models whose layers do not all run alike (a layer that reads its index, an output
made of every layer's output, layers run in another order or twice) are exported whole,
and that whole graph still computes the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fxpipe import meta
from fxpipe.frontend import trace
from fxpipe.kernels import Execution
from fxpipe.passes import annotate_all
from fxpipe.precision import Precision
from fxpipe.tracing.export import export_program, exported_graph
from fxpipe.tracing.layer_runs import (
    FIRST,
    MIN_LAYERS,
    Repeat,
    cut,
    first_repeat,
    layer_lists,
    record,
    repeat_of,
    same_run,
)
from fxpipe.tracing.repeats import _layered, export_in_layers, to_try
from tests.codegen._models import assert_runner_matches, import_package, write_package
from tests.codegen._plans import contiguous_plan

transformers = pytest.importorskip("transformers")

LAYERS = MIN_LAYERS
VOCAB = 100


def _ids(rows: int = 2, length: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _llama(layers: int = LAYERS) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4,
                                     n_positions=64, bos_token_id=1, eos_token_id=2,
                                     use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=LAYERS, num_attention_heads=4)
    return transformers.BertForMaskedLM(config)


def _falcon() -> nn.Module:
    # Each layer indexes with torch.tensor([-2]): a constant export lifts out of the layer.
    config = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        new_decoder_architecture=False, multi_query=True, alibi=False, use_cache=False)
    return transformers.FalconForCausalLM(config)


def _gemma2(layers: int = LAYERS) -> nn.Module:
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False)
    return transformers.Gemma2ForCausalLM(config)


def _built(make: Any) -> nn.Module:
    torch.manual_seed(0)
    return make().train()


def _canonical(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    """The graph without node names: each node's op, target, arguments (nodes by position,
    parameters by name) and module stack."""
    position = {node: p for p, node in enumerate(gm.graph.nodes)}

    def arg(node: torch.fx.Node) -> Any:
        return ("attr", node.target) if node.op == "get_attr" else ("node", position[node])

    return [
        (node.op, str(node.target), repr(torch.fx.map_arg(node.args, arg)),
         repr(torch.fx.map_arg(node.kwargs, arg)),
         tuple(path for path, _ in (node.meta.get("nn_module_stack") or {}).values()))
        for node in gm.graph.nodes
    ]


def _run(gm: torch.fx.GraphModule, flat: tuple[Any, ...]) -> torch.Tensor:
    out = torch.fx.Interpreter(gm).run(*flat)
    return out if isinstance(out, torch.Tensor) else out[0]


def _assert_computes_the_model(gm: torch.fx.GraphModule, model: nn.Module,
                               flat: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The graph run on the example gives the model's logits (dropout drawing the same
    masks: the same seed, the same ops in the same order)."""
    with torch.no_grad():
        torch.manual_seed(1)
        got = torch.fx.Interpreter(gm).run(*flat)
        torch.manual_seed(1)
        want = model(**kwargs)
    logits = want.logits if hasattr(want, "logits") else want
    torch.testing.assert_close(got.logits if hasattr(got, "logits") else got[0], logits)


def _records(gm: torch.fx.GraphModule, flat: tuple[Any, ...],
             execution: Execution) -> list[tuple[Any, ...]]:
    """Every node's shapes, FLOPs, bytes and module path (a parameter's owner is a plain
    holder module on both graphs, of another class on each)."""
    annotate_all(gm, *flat, execution=execution)
    return [(meta.SHAPE.get(n), meta.FLOPS.get(n), meta.BYTES.get(n), meta.MODULE.get(n).stack)
            for n in gm.graph.nodes]


@pytest.mark.parametrize("make", [_llama, _gpt2, _bert, _falcon],
                         ids=["llama", "gpt2", "bert", "falcon"])
def test_the_copies_are_the_graph_a_whole_export_gives(make: Any) -> None:
    model = _built(make)
    kwargs = {"input_ids": _ids()}
    layered = export_in_layers(model, (), kwargs)
    assert layered is not None, "the layers were not copied"
    gm, flat, inputs, fixed, note = layered
    assert fixed is None and f"{LAYERS} of" in note
    assert note.startswith(f"exported {FIRST.depth} layers"), note
    program, _ = export_program(model, (), kwargs)
    whole, whole_flat, whole_inputs = exported_graph(program, (), kwargs)
    assert _canonical(gm) == _canonical(whole)
    assert inputs == whole_inputs
    _assert_computes_the_model(gm, model, flat, kwargs)
    # The passes take a copy's records from the node it copies, unrun: the records are
    # the whole export's (on fake CPU tensors too, as bf16-mixed runs them).
    assert sum(meta.COPY_OF.has(n) for n in gm.graph.nodes) >= (LAYERS - FIRST.depth) * 10
    assert not any(meta.COPY_OF.has(n) for n in whole.graph.nodes)
    for precision in (None, Precision.BF16_MIXED) if make is _llama else (None,):
        execution = Execution(precision=precision)
        assert _records(gm, flat, execution) == _records(whole, whole_flat, execution)


def _glm4_moe() -> nn.Module:
    # The first layer's feed-forward is dense, the next six route to experts.
    config = transformers.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS + 1,
        num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=16,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, use_cache=False,
        experts_implementation="batched_mm")
    return transformers.Glm4MoeForCausalLM(config)


def test_layers_after_a_dense_first_one_are_copied_from_the_fourth() -> None:
    """A list whose first layer is built otherwise (a dense feed-forward before the
    experts) is exported four deep: the second layer reads the first, so it runs unlike
    the third, and the third and fourth are the two compared; the fourth is copied. The
    graph is the one a whole export gives, and it computes the model's logits."""
    model = _built(_glm4_moe)
    (layers,) = layer_lists(model)
    assert layers.alike_from == 1 and first_repeat([layers]) == Repeat(4)
    kwargs = {"input_ids": _ids()}
    layered = export_in_layers(model, (), kwargs)
    assert layered is not None, "the layers were not copied"
    gm, flat, inputs, _, note = layered
    assert note.startswith("exported 4 layers"), note
    assert sum(meta.COPY_OF.has(n) for n in gm.graph.nodes) >= (LAYERS - 3) * 10
    program, _ = export_program(model, (), kwargs)
    whole, _, whole_inputs = exported_graph(program, (), kwargs)
    assert _canonical(gm) == _canonical(whole)
    assert inputs == whole_inputs
    _assert_computes_the_model(gm, model, flat, kwargs)


class _Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


class _ReadsItsIndex(_Layer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 2 if self.index == LAYERS - 1 else y


class _MakesAConstant(_Layer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.tensor([2.0])


class _MakesItsIndex(_Layer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.tensor([float(self.index)])


class _AddsTheFirst(_Layer):
    def forward(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        y = super().forward(x)
        return y if first is None else y + first


class _Stack(nn.Module):
    """Layers in a list, run as ``how`` says."""

    def __init__(self, how: str, layer: type[_Layer] = _Layer) -> None:
        super().__init__()
        self.how = how
        self.layers = nn.ModuleList(layer(i) for i in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = list(self.layers)
        if self.how == "reversed":
            order.reverse()
        if self.how == "twice":
            order = order + order
        outputs = []
        for layer in order:
            x = layer(x, outputs[0]) if self.how == "reads the first" and outputs else layer(x)
            outputs.append(x)
        if self.how == "every output":
            return torch.stack(outputs).sum(0)
        return x


def test_layers_that_read_the_first_ones_output_are_copied_three_deep() -> None:
    """Every layer after the first adds the first's output: layer 1 reads it as the layer
    before, the later ones as one fixed value, so layer 1 is not the one to copy; three
    are exported and the third copied, which is the graph a whole export gives."""
    model, x = _Stack("reads the first", _AddsTheFirst), torch.randn(4, 16)
    layered = export_in_layers(model, (x,), {})
    assert layered is not None, "the layers were not copied"
    assert layered[4].startswith("exported 3 layers"), layered[4]
    program, _ = export_program(model, (x,), {})
    whole, _, _ = exported_graph(program, (x,), {})
    assert _canonical(layered[0]) == _canonical(whole)
    with torch.no_grad():
        torch.testing.assert_close(_run(layered[0], layered[1]), model(x))
    assert _records(layered[0], layered[1], Execution()) == _records(whole, (x,), Execution())


def test_a_constant_every_layer_makes_is_copied_with_each_layer() -> None:
    # torch.export lifts `torch.tensor([2.0])` to the top of the graph, outside the layer's
    # nodes; it is still the layer's, one per layer, where a whole export has them.
    model, x = _Stack("in order", _MakesAConstant), torch.randn(4, 16)
    layered = export_in_layers(model, (x,), {})
    assert layered is not None, "the layers were not copied"
    program, _ = export_program(model, (x,), {})
    whole, _, _ = exported_graph(program, (x,), {})
    assert _canonical(layered[0]) == _canonical(whole)
    with torch.no_grad():
        torch.testing.assert_close(_run(layered[0], layered[1]), model(x))


@pytest.mark.parametrize("model", [
    _Stack("in order", _ReadsItsIndex), _Stack("in order", _MakesItsIndex),
    _Stack("reversed"), _Stack("twice"), _Stack("every output"),
], ids=["a layer reads its index", "a layer makes a constant of its index", "reversed",
        "twice", "every layer's output"])
def test_layers_that_do_not_all_run_alike_are_exported_whole(model: nn.Module) -> None:
    x = torch.randn(4, 16)
    assert export_in_layers(model, (x,), {}) is None
    program, _ = export_program(model, (x,), {})
    gm, flat, _ = exported_graph(program, (x,), {})
    with torch.no_grad():
        torch.testing.assert_close(_run(gm, flat), model(x))


@pytest.mark.parametrize("model, args, kwargs", [
    (_Stack("in order", _ReadsItsIndex), (torch.randn(4, 16),), {}),
    (_Stack("reversed"), (torch.randn(4, 16),), {}),
    (_Stack("twice"), (torch.randn(4, 16),), {}),
    (_Stack("every output"), (torch.randn(4, 16),), {}),
    (_built(_gemma2), (), {"input_ids": _ids()}),
], ids=["a layer reads its index", "reversed", "twice", "every layer's output", "gemma2"])
def test_the_recorded_runs_tell_layers_that_differ(model: nn.Module, args: tuple[Any, ...],
                                                   kwargs: dict[str, Any]) -> None:
    """The check on its own, before any export: each of these runs otherwise than the
    model cut to two or three layers and the last copied would (Gemma-2 repeats every
    other layer, not every layer)."""
    lists = layer_lists(model)
    assert [len(layers.modules) for layers in lists] == [LAYERS]
    whole = record(model, args, kwargs, lists)
    assert whole is not None
    for repeat in (FIRST, Repeat(3)):
        with cut(lists, repeat.depth):
            kept = record(model, args, kwargs, lists)
        assert kept is not None
        assert not same_run(whole, kept, lists, repeat)


def test_the_same_layers_in_order_are_copied() -> None:
    """The control for the test above: the same model, run plainly, is copied."""
    model = _Stack("in order")
    x = torch.randn(4, 16)
    layered = export_in_layers(model, (x,), {})
    assert layered is not None
    gm, flat, *_ = layered
    with torch.no_grad():
        torch.testing.assert_close(_run(gm, flat), model(x))


def _gpt_oss() -> nn.Module:
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=LAYERS + 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, use_cache=False)
    return transformers.GptOssForCausalLM(config)


def test_alternating_layers_are_copied_in_turn() -> None:
    """Gemma-2 alternates sliding-window and full attention layer by layer: the recorded
    run repeats every other layer, four layers are exported and the last two copied in
    turn, which is the graph a whole export gives. (The way there from the model cut to
    two layers, which runs otherwise, is the fuzz test's "alternate" variation.)"""
    model = _built(lambda: _gemma2(LAYERS + 2))
    kwargs = {"input_ids": _ids()}
    lists = layer_lists(model)
    whole_run = record(model, (), kwargs, lists)
    assert whole_run is not None
    assert repeat_of(whole_run, lists) == Repeat(4, 2)
    layered = _layered(model, (), kwargs, lists, Repeat(4, 2), whole_run)
    assert layered is not None and layered.graph is not None
    gm, flat, inputs = layered.graph
    program, _ = export_program(model, (), kwargs)
    whole, whole_flat, whole_inputs = exported_graph(program, (), kwargs)
    assert _canonical(gm) == _canonical(whole)
    assert inputs == whole_inputs
    assert sum(meta.COPY_OF.has(n) for n in gm.graph.nodes) >= 4 * 10
    _assert_computes_the_model(gm, model, flat, kwargs)
    assert _records(gm, flat, Execution()) == _records(whole, whole_flat, Execution())


def test_a_mixture_of_experts_that_alternates_is_recorded_and_copied_one_period_deeper(
) -> None:
    """GPT-OSS: its float32 grouped_mm runs on fake tensors as export runs it (the
    fallback op), so its run is recorded, and repeats every other layer from the second.
    Export writes shape arithmetic into its first layer alone, so layers 0 and 2 differ
    as graphs: one period deeper, six exported, the copies compute the model. With
    eight layers six are more than the two left to copy: the model is exported whole."""
    model = _built(_gpt_oss)
    kwargs = {"input_ids": _ids()}
    lists = layer_lists(model)
    whole_run = record(model, (), kwargs, lists)
    assert whole_run is not None
    assert repeat_of(whole_run, lists) == Repeat(4, 2)
    assert to_try(Repeat(4, 2), lists, FIRST) == [Repeat(4, 2)]  # six deep: not worth it
    layered = _layered(model, (), kwargs, lists, Repeat(6, 2), whole_run)
    assert layered is not None and layered.graph is not None
    gm, flat, _ = layered.graph
    assert sum(meta.COPY_OF.has(n) for n in gm.graph.nodes) >= 2 * 10
    _assert_computes_the_model(gm, model, flat, kwargs)


def test_a_pipeline_of_copied_layers_is_transparent(tmp_path: Path) -> None:
    """Split into three stages across the copies: outputs, loss and every gradient equal
    the model's, at the traced shape and at another."""
    model = _built(lambda: _llama(LAYERS + 2))
    kwargs = {"input_ids": _ids()}
    traced = trace(model, (), kwargs)
    assert any("copied" in note for note in traced.notes), traced.notes
    plan = contiguous_plan(traced.gm.graph, 3, schedule="1f1b", microbatches=2,
                           model="hf_llama", shared_inputs=traced.shared_inputs)
    write_package(tmp_path / "pkg", traced, plan)
    package = import_package(tmp_path / "pkg")
    runner = package.PipelineRunner(package.build_stages(model))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out["logits"] if isinstance(out, dict) else out.logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    for rows, length in ((4, 8), (6, 5)):
        ids = _ids(rows, length, seed=rows)
        assert_runner_matches(runner, model, (), {"input_ids": ids}, _ids(rows, length, 9),
                              loss_fn, what=f"{rows} x {length}")


class _Cached(_Layer):
    """Keeps a tensor it makes on its first forward, as rotary embeddings once did."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scale"):
            self.scale = torch.ones(x.shape[-1], device=x.device) * 0.5
        return super().forward(x) * self.scale


def test_the_recorded_runs_leave_the_model_as_it_was() -> None:
    """The fake-tensor runs must not leave fake tensors behind in the model (export
    itself is another matter: torch warns of such attributes)."""
    model = _Stack("in order", _Cached)
    x = torch.randn(4, 16)
    lists = layer_lists(model)
    assert record(model, (x,), {}, lists) is not None
    with cut(lists, FIRST.depth):
        assert record(model, (x,), {}, lists) is not None
    assert not any(hasattr(layer, "scale") for layer in model.layers)
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == LAYERS
