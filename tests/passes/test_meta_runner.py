"""The meta-device interpreter every pass shares: device literals, grad mode, failures,
and the byte pass recording shapes in the same run."""

from __future__ import annotations

import pytest
import torch

from fxpipe import meta
from fxpipe.frontend import trace
from fxpipe.kernels import Execution
from fxpipe.metadevice import on_meta, to_meta
from fxpipe.passes import AnalysisError, annotate_flops, annotate_memory, annotate_shapes
from fxpipe.precision import Precision
from tests.passes.test_flops import import_example


class DeviceLiterals(torch.nn.Module):
    """Ops that name the CPU: export records the device of the trace in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-1], device=x.device).to(torch.device("cpu"))
        return self.lin(x).cpu() + positions


def test_cpu_device_literals_run_on_meta() -> None:
    traced = trace(DeviceLiterals(), (torch.randn(2, 4),))
    annotate_shapes(traced.gm, *traced.flat_inputs)
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    assert meta.SHAPE.get(out).tensors[0].shape == (2, 4)


class Broken(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(3, 3)  # (2, 4) @ (3, 3): fails at this node


def test_a_failed_analysis_names_the_node_and_restores_grad_mode() -> None:
    gm = torch.fx.symbolic_trace(Broken())
    assert torch.is_grad_enabled()
    with torch.no_grad():
        with pytest.raises(AnalysisError, match="matmul"):
            annotate_shapes(gm, torch.randn(2, 4))
        assert not torch.is_grad_enabled()  # the caller's mode, restored
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("precision", [None, Precision.BF16_MIXED])
def test_the_byte_pass_records_the_shapes_the_shape_pass_does(
        precision: Precision | None) -> None:
    """annotate_all takes shapes and bytes from one run of the graph (annotate_memory with
    shapes=True): every node's record is the one the shape pass gives, under autocast too."""
    model = import_example("hf_llama")
    traced = trace(model.build_model(), kwargs=model.example_inputs())
    execution = Execution(precision=precision)
    gm = traced.gm
    annotate_shapes(gm, *traced.flat_inputs, execution=execution)
    alone = {node: meta.SHAPE.get(node) for node in gm.graph.nodes}
    for node in gm.graph.nodes:
        del node.meta[meta.SHAPE.name]
    annotate_memory(gm, *traced.flat_inputs, execution=execution, shapes=True)
    assert {node: meta.SHAPE.get(node) for node in gm.graph.nodes} == alone
    dtypes = {t.dtype for info in alone.values() for t in info.tensors}
    assert ("bfloat16" in dtypes) == (precision is Precision.BF16_MIXED)


@pytest.mark.parametrize("precision", [None, Precision.BF16_MIXED])
def test_the_byte_pass_counts_the_flops_and_bytes_the_passes_alone_do(
        precision: Precision | None) -> None:
    """annotate_all counts FLOPs in the byte pass's run too (annotate_memory with
    flops=True): every node's FLOPs and bytes are the ones each pass gives alone, though
    the FLOPs are counted outside the hooks that see what backward saves."""
    model = import_example("hf_llama")
    traced = trace(model.build_model(), kwargs=model.example_inputs())
    execution = Execution(precision=precision)
    gm = traced.gm
    annotate_flops(gm, *traced.flat_inputs, execution=execution)
    annotate_memory(gm, *traced.flat_inputs, execution=execution)
    alone = {node: (meta.FLOPS.get(node), meta.BYTES.get(node)) for node in gm.graph.nodes}
    for node in gm.graph.nodes:
        del node.meta[meta.FLOPS.name], node.meta[meta.BYTES.name]
    annotate_memory(gm, *traced.flat_inputs, execution=execution, flops=True)
    together = {node: (meta.FLOPS.get(node), meta.BYTES.get(node)) for node in gm.graph.nodes}
    assert together == alone
    assert sum(flops.backward_weight for flops, _ in together.values()) > 0
    assert sum(info.saved_bytes for _, info in together.values()) > 0


def test_a_graph_traced_for_the_gpu_runs_under_mixed_precision() -> None:
    """A mixture of experts built on the meta device takes transformers' GPU path, which
    counts tokens per expert with ``histc`` of integers; a *-mixed analysis runs on fake
    CPU tensors, which refused it (an internal error on GPT-OSS-20B with bf16-mixed)."""
    from tests.passes.test_flops import MOE_BATCH, MOE_SEQ, _mixtral

    traced = trace(_mixtral("meta"), (), {"input_ids": torch.randint(0, 100, (MOE_BATCH,
                                                                            MOE_SEQ))})
    assert any("histc" in str(n.target) for n in traced.gm.graph.nodes)
    execution = Execution("cuda", precision=Precision.BF16_MIXED)
    annotate_flops(traced.gm, *traced.flat_inputs, execution=execution)
    experts = [n for n in traced.gm.graph.nodes if "grouped_mm" in str(n.target)]
    assert experts and all(meta.FLOPS.get(n).forward > 0 for n in experts)


class Aliased(torch.nn.Module):
    """One embedding registered under three names and tied to the head, as transformers
    4.x registers T5's: ``shared``, ``encoder.embed_tokens``, ``decoder.embed_tokens``."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Embedding(10, 4)
        self.encoder, self.decoder = torch.nn.Module(), torch.nn.Module()
        self.encoder.embed_tokens = self.decoder.embed_tokens = self.shared
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder.embed_tokens(ids) + self.decoder.embed_tokens(ids))


def test_a_module_of_several_names_gets_its_own_parameters_back() -> None:
    """torch's reparametrization swapped such a slot once per name and put a meta copy
    back: after tracing, T5's embedding was a meta tensor, untied from its LM head, and the
    pipeline's gradient never reached it ('shared.weight has a gradient only in the model')."""
    model = Aliased()
    weight = model.shared.weight
    with on_meta(model) as state:
        assert model.shared.weight.is_meta and model.head.weight is model.shared.weight
        assert state["encoder.embed_tokens.weight"] is state["head.weight"]
    assert model.shared.weight is weight and model.head.weight is weight
    traced = trace(model, (torch.randint(0, 10, (2, 3)),))
    annotate_memory(traced.gm, *traced.flat_inputs)
    assert model.shared.weight is weight and model.head.weight is weight


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_meta_copy_has_the_strides_empty_like_gives(device: str) -> None:
    """``to_meta`` makes a row-major tensor with ``torch.empty`` (empty_like runs a Python
    decomposition on meta, 25x slower) and any other with empty_like: the copies have
    empty_like's shape, strides, dtype and grad either way, also where a size-1
    dimension leaves the strides ambiguous (channels-last, a (1, k) of stride (100, 1))."""
    base = torch.empty(2, 3, 4, 5, device=device)
    tensors = [
        torch.empty(3, 4, device=device), torch.empty((), device=device),
        torch.empty(0, 3, device=device), torch.empty(2, 1, 1, device=device),
        torch.nn.Parameter(torch.empty(4, 1, device=device)),
        torch.empty_strided((1, 4), (100, 1), device=device),
        torch.empty_strided((4, 1), (1, 7), device=device),
        base.to(memory_format=torch.channels_last), base.transpose(0, 1), base[:, :, ::2],
        torch.empty(2, 3, 1, 1, device=device).to(memory_format=torch.channels_last),
        torch.empty(2, 1, 4, 4, device=device).to(memory_format=torch.channels_last),
        torch.empty(3, 4, dtype=torch.int64, device=device),
    ]
    for tensor in tensors:
        for dtype in (None, torch.float16):
            copy = to_meta(tensor, dtype=dtype)
            floating = tensor.is_floating_point()
            want = torch.empty_like(tensor, dtype=dtype if floating else None, device="meta")
            assert copy.is_meta and type(copy) is torch.Tensor
            assert (copy.shape, copy.stride(), copy.dtype) == (want.shape, want.stride(),
                                                               want.dtype), tensor.stride()
            assert copy.requires_grad == (floating and tensor.requires_grad)
