"""Every example traces and profiles: load_model_file -> trace -> annotate_all -> roofline
-> summarize, with the tracer we expect and records on every op node."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fxpipe import meta
from fxpipe.cost_models import analytic, get_device
from fxpipe.frontend import load_model_file, trace
from fxpipe.passes import annotate_all
from fxpipe.passes.base import OP_NODES
from fxpipe.profile import summarize
from fxpipe.tracing.export import export_program
from fxpipe.tracing.functions import Applied
from fxpipe.tracing.records import TraceError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# example file -> the tracer that must capture it
CASES = {
    "mlp.py": "symbolic_trace",
    "resnet.py": "symbolic_trace",
    "unet.py": "symbolic_trace",
    "gpt.py": "symbolic_trace",
    "hf_gpt2.py": "export",
    "hf_llama.py": "export",
    "hf_bert.py": "export",
    "hf_t5.py": "export",
    "hf_vit.py": "export",
}
PARAMS = [pytest.param(example, tracer, id=example) for example, tracer in CASES.items()]
RECORDS = (meta.SHAPE, meta.MODULE, meta.FLOPS, meta.BYTES, meta.TIME)


def unique_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, a tied parameter counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())  # deduplicates


@pytest.mark.parametrize(("example", "tracer"), PARAMS)
def check_profile(spec: str, tracer: str, *, on_meta: bool = False) -> None:
    if on_meta:
        with torch.device("meta"):  # weights and example inputs built without storage
            source = load_model_file(spec)
        assert all(p.is_meta for p in source.model.parameters())
    else:
        source = load_model_file(spec)
    traced = trace(source.model, source.args, source.kwargs)
    assert traced.tracer == tracer
    if tracer == "export":
        assert traced.fallback_reason, "the report must say why symbolic_trace was not used"
    else:
        assert traced.fallback_reason is None

    annotate_all(traced.gm, *traced.flat_inputs)
    analytic.annotate_times(traced.gm, get_device("h100"))
    rows, total = summarize(traced.gm)

    op_nodes = [n for n in traced.gm.graph.nodes if n.op in OP_NODES]
    assert op_nodes
    for node in op_nodes:
        missing = [key.name for key in RECORDS if not key.has(node)]
        assert not missing, f"{node.format_node()} lacks {missing}"

    node_forward = sum(meta.FLOPS.get(n).forward for n in traced.gm.graph.nodes)
    assert total.flops_forward > 0
    assert total.flops_forward == node_forward
    assert sum(r.flops_forward for r in rows) == total.flops_forward
    assert total.forward_s > 0 and total.backward_s > 0
    assert total.param_bytes == unique_param_bytes(source.model), (
        f"summary {total.param_bytes} B vs model {unique_param_bytes(source.model)} B"
    )


@pytest.mark.parametrize(("example", "tracer"), PARAMS)
def test_example_traces_and_profiles(example: str, tracer: str) -> None:
    check_profile(str(EXAMPLES / example), tracer)


@pytest.mark.parametrize("example", [e for e, t in CASES.items() if t == "export"])
def test_transformers_example_built_on_meta_traces_and_profiles(example: str) -> None:
    """The same transformers examples built under ``torch.device("meta")``."""
    check_profile(str(EXAMPLES / example), "export", on_meta=True)


class _NoGradCast(nn.Module):
    """A buffer cast to float32 inside a no-grad region, as Llama's rotary embedding did
    before transformers 5.2x (which dropped the region)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.rand(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.inv_freq.to(torch.float32).cos()
        return self.lin(x) * scale.to(x.dtype)


def test_export_checks_are_gone_from_higher_order_bodies_too() -> None:
    """torch.export asserts each value's traced dtype (``aten._assert_tensor_metadata``
    before a ``to``), inside the body of a no-grad region too: a model cast to bfloat16
    must run the graph, so none of those assertions is left anywhere."""
    model, x = _NoGradCast(), torch.randn(2, 8)
    assert _metadata_checks(torch.export.export(model, (x,), strict=False).module())
    traced = trace(model, (x,), {})
    assert len(_graphs(traced.gm)) > 1  # the no-grad region is a body of its own
    assert not _metadata_checks(traced.gm)
    llama = load_model_file(str(EXAMPLES / "hf_llama.py"))
    assert not _metadata_checks(trace(llama.model, llama.args, llama.kwargs).gm)


class _RepeatedHeads(nn.Module):
    """transformers' repeat_kv: ``x[:, :, None, :, :]`` traces under export as slices of
    the whole of each dimension, which eager indexing does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).view(x.shape[0], 2, x.shape[1], 4)
        if h.dtype == torch.float16:  # a branch on a value: symbolic_trace cannot
            h = h.clamp(-1, 1)
        repeated = h[:, :, None, :, :].expand(x.shape[0], 2, 3, x.shape[1], 4)
        return repeated.reshape(x.shape[0], 6, x.shape[1], 4)[..., 1:].sum(1)


def test_slices_of_a_whole_tensor_are_not_in_the_graph() -> None:
    """Export records ``x[:, :, None]`` as slices of all of ``x``; eager indexing returns
    ``x`` itself. The graph reads ``x`` there, so the stages run what the model runs (and
    their backward copies no gradient into a new tensor), and the partial slice stays."""
    model, x = _RepeatedHeads(), torch.randn(2, 5, 8)
    program, _fixed = export_program(model, (x,), {})  # free sizes: export keeps the slices
    full = [n for n in program.module().graph.nodes if n.target is torch.ops.aten.slice.Tensor]
    assert len(full) >= 3
    traced = trace(model, (x,), {})
    assert traced.tracer == "export"
    slices = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor]
    assert [n.args[2:] for n in slices] == [(1, 9223372036854775807)]  # the [..., 1:]
    y = torch.randn(3, 7, 8, requires_grad=True)  # another batch and length
    torch.testing.assert_close(traced.gm(y), model(y))
    traced.gm(y).square().sum().backward()
    want = y.grad.clone()
    y.grad = None
    model(y).square().sum().backward()
    torch.testing.assert_close(want, y.grad)


def _graphs(gm: torch.nn.Module) -> list[torch.fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def _metadata_checks(gm: torch.nn.Module) -> list[torch.fx.Node]:
    return [n for body in _graphs(gm) for n in body.graph.nodes
            if n.target is torch.ops.aten._assert_tensor_metadata.default]


def test_an_export_graph_is_not_analysed_at_another_true_precision() -> None:
    """The graph holds casts to the dtype it was traced at (RMSNorm's ``to(input_dtype)``
    became ``to(float32)``): its costs at bf16-true would not be the cast model's."""
    from fxpipe.compiler import analyze
    from fxpipe.precision import Precision

    source = load_model_file(str(EXAMPLES / "hf_llama.py"))
    traced = trace(source.model, source.args, source.kwargs)
    with pytest.raises(ValueError, match=r"model\.to\(torch\.bfloat16\)"):
        analyze(traced, device=get_device("cpu"), precision=Precision.BF16_TRUE)
    analyze(traced, device=get_device("cpu"), precision=Precision.BF16_MIXED)  # autocast: fine


class _Reverse(torch.autograd.Function):
    """A gradient reversal layer: identity forward, negated gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class _Reversing(nn.Module):
    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.a, self.b, self.branch = nn.Linear(4, 4), nn.Linear(4, 2), branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not self.branch or h.shape[0] > 0:  # a branch on a size: export, not symbolic
            h = _Reverse.apply(h)
        return self.b(h)


@pytest.mark.parametrize(("branch", "tracer"), [(False, "symbolic_trace"), (True, "export")])
def test_a_custom_autograd_function_is_kept_as_one_call(branch: bool, tracer: str) -> None:
    """Both tracers record the Function's call as one node: the graph runs its backward,
    so its gradients are the model's; no note."""
    model, x = _Reversing(branch), torch.randn(3, 4)
    apply = torch.autograd.Function.__dict__["apply"]
    traced = trace(model, (x,), {})
    assert traced.tracer == tracer
    assert not [n for n in traced.notes if "torch.autograd.Function" in n], traced.notes
    (call,) = [n for n in traced.gm.graph.nodes if isinstance(n.target, Applied)]
    assert call.target.function is _Reverse
    model(x).sum().backward()
    want = model.a.weight.grad.clone()
    model.zero_grad()
    traced.gm(x).sum().backward()
    torch.testing.assert_close(model.a.weight.grad, want)
    assert torch.autograd.Function.__dict__["apply"] is apply  # put back


def _reversing_with_a_local_function(branch: bool) -> nn.Module:
    class LocalReverse(_Reverse):  # defined in a function: no stage can find it by name
        pass

    class Local(_Reversing):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if not self.branch or h.shape[0] > 0:  # a branch on a size: export
                h = LocalReverse.apply(h)
            return self.b(h)

    return Local(branch)


class _Sign:
    """An object of the model's, which no graph node can hold."""

    value = -1.0


class _Signed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sign: _Sign) -> torch.Tensor:
        ctx.sign = sign.value
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.sign * grad, None


def _reversing_by_an_object(branch: bool) -> nn.Module:
    class BySign(_Reversing):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if not self.branch or h.shape[0] > 0:  # a branch on a size: export
                h = _Signed.apply(h, _Sign())
            return self.b(h)

    return BySign(branch)


@pytest.mark.parametrize("branch", [False, True], ids=["symbolic_trace", "export"])
@pytest.mark.parametrize(("build", "name"), [
    (_reversing_with_a_local_function, "LocalReverse"), (_reversing_by_an_object, "_Signed"),
], ids=["defined-in-a-function", "given-an-object"])
def test_a_custom_autograd_function_run_through_is_named_in_a_note(
    build: Callable[[bool], nn.Module], name: str, branch: bool
) -> None:
    """Neither tracer keeps a torch.autograd.Function defined inside a function, nor a
    call given an object no graph can hold: the graph holds the ops of its forward (here
    an identity, whose gradient is not the reversed one). The trace says so, naming the
    Function and where it is defined."""
    model, x = build(branch), torch.randn(3, 4)
    apply = torch.autograd.Function.__dict__["apply"]
    traced = trace(model, (x,), {})
    assert traced.tracer == ("export" if branch else "symbolic_trace")
    (note,) = [n for n in traced.notes if "torch.autograd.Function" in n]
    assert f"{name} ({__file__}:" in note and "not its backward" in note
    # what the note warns of: the graph's gradient is the identity's, the model's reversed
    model(x).sum().backward()
    want = model.a.weight.grad.clone()
    model.zero_grad()
    traced.gm(x).sum().backward()
    torch.testing.assert_close(model.a.weight.grad, -want)
    assert torch.autograd.Function.__dict__["apply"] is apply  # put back


class _ReversingWithoutAutocast(_Reversing):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):  # a region: export, as a higher-order op
            h = _Reverse.apply(h.float())
        return self.b(h)


def test_a_function_export_cannot_keep_is_run_through_with_a_note() -> None:
    """torch.export cannot hold a Function's call inside an autocast region; the model is
    exported again running through it (as before it was kept anywhere), and named."""
    model, x = _ReversingWithoutAutocast(branch=False), torch.randn(3, 4)
    traced = trace(model, (x,), {})
    assert traced.tracer == "export"
    (note,) = [n for n in traced.notes if "torch.autograd.Function" in n]
    assert f"_Reverse ({__file__}:" in note
    assert not [n for n in traced.gm.graph.nodes if isinstance(n.target, Applied)]


class _Recomputed(torch.autograd.Function):
    """A memory-saving Function (as Reformer's reversible layers): its forward runs the
    block under no_grad, its backward runs it again with grad and differentiates that."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, block: nn.Module) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.block = block
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(ctx.block(x), grad)
        return x.grad, None


class _Scaled(torch.autograd.Function):
    """Its forward sets the grad mode too, but it takes only tensors: it is kept."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _Reversible(_Reversing):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__(branch=True)
        self.block, self.function = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.function is _Recomputed:
            h = _Recomputed.apply(h, self.block)
        else:
            h = _Scaled.apply(self.block(h))
        return self.b(h)


def test_a_function_run_through_that_sets_the_grad_mode_is_refused() -> None:
    """Run through (it is given a module), the Function's forward ops run without grad,
    and export records the mode its no_grad leaves for every op after it: the pipeline
    would have no gradients from there on. The trace refuses it in one line naming it."""
    model = _Reversible(_Recomputed)
    with pytest.raises(TraceError) as refused:
        trace(model, (torch.randn(3, 4),), {})
    message = str(refused.value)
    assert "\n" not in message
    assert f"_Recomputed ({__file__}:" in message and "sets the grad mode" in message


def test_a_kept_function_that_sets_the_grad_mode_is_called_as_the_model_does() -> None:
    """Kept as one call, such a Function runs its own backward in the stages: no refusal,
    and the graph's gradients are the model's."""
    model, x = _Reversible(_Scaled), torch.randn(3, 4)
    traced = trace(model, (x,), {})
    assert [n for n in traced.gm.graph.nodes if isinstance(n.target, Applied)]
    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    traced.gm(x).sum().backward()
    for got, expected in zip((p.grad for p in model.parameters()), want, strict=True):
        torch.testing.assert_close(got, expected)


class _TensorHooked(_Reversing):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.shape[0] > 0 and h.requires_grad:  # a branch on a size: export
            h.register_hook(lambda grad: -grad)
        return self.b(h)


@pytest.mark.parametrize("kind", ["module", "tensor", "every-module"])
def test_backward_hooks_the_stages_do_not_run_are_named_in_a_note(kind: str) -> None:
    """torch.export inlines every module, so a module's backward hooks do not run in the
    stages; nor does a hook forward registers on a tensor, nor one registered for every
    module around an inlined one. Each is named in a note, with what to do instead."""
    model = _TensorHooked(branch=True) if kind == "tensor" else _Reversing(branch=True)
    handles = []
    if kind == "module":
        handles.append(model.a.register_full_backward_hook(lambda m, gi, go: (-gi[0],)))
    if kind == "every-module":
        handles.append(torch.nn.modules.module.register_module_full_backward_hook(
            lambda m, gi, go: None))
    try:
        traced = trace(model, (torch.randn(3, 4, requires_grad=True),), {})
    finally:
        for handle in handles:
            handle.remove()
    assert traced.tracer == "export"
    (note,) = [n for n in traced.notes if "hook" in n]
    want = {"module": "the backward hooks of a do not run in the stages",
            "tensor": f"forward registers a hook on a tensor it computes ({__file__}:",
            "every-module": "backward hooks registered for every module run only"}[kind]
    assert want in note, note
    if kind != "every-module":
        assert "torch.autograd.Function" in note  # what to do instead


def test_parameter_hooks_are_not_named() -> None:
    """A hook on a parameter fires in the stages, which train the model's parameters."""
    model = _Reversing(branch=True)
    model.a.weight.register_hook(lambda grad: -grad)
    traced = trace(model, (torch.randn(3, 4),), {})
    assert not [n for n in traced.notes if "hook" in n], traced.notes


def test_torch_own_autograd_functions_are_not_named() -> None:
    """A Function of torch's own (reentrant checkpoint's, whose backward runs the forward
    again) computes the forward's derivative: no note."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 0:
                return checkpoint(self.lin, x, use_reentrant=True)
            return x

    traced = trace(Checkpointed(), (torch.randn(3, 4, requires_grad=True),), {})
    assert not [n for n in traced.notes if "torch.autograd.Function" in n], traced.notes


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, branch: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.reentrant, self.branch = reentrant, branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        if self.branch and x.shape[0] == 0:  # a branch on a size: export
            return x
        h = checkpoint(self.a, x, use_reentrant=self.reentrant)
        return self.b(checkpoint(torch.tanh, h, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("branch", [False, True], ids=["symbolic_trace", "export"])
def test_the_models_own_checkpointing_is_named_in_a_note(reentrant: bool, branch: bool) -> None:
    """The tracers record a checkpointed region's ops once: the note says the stages keep
    what it saves and fxpipe's recompute decides instead; the graph computes the model's
    gradients."""
    model = _Checkpointed(reentrant, branch)
    x = torch.randn(3, 4, requires_grad=True)
    traced = trace(model, (x,), {})
    (note,) = [n for n in traced.notes if "checkpoints its own activations" in n]
    assert "(torch.utils.checkpoint of 2 callables)" in note
    import torch.utils.checkpoint as checkpoint

    assert checkpoint.CheckpointFunction.__name__ == "CheckpointFunction"  # put back
    model(x).sum().backward()
    want = model.a.weight.grad.clone()
    model.zero_grad()
    traced.gm(x).sum().backward()
    torch.testing.assert_close(model.a.weight.grad, want)


def test_transformers_gradient_checkpointing_trains_every_layer() -> None:
    """transformers' activation checkpointing, reentrant: traced as it runs,
    each layer ran under no_grad and the graph gave its parameters no gradient. Traced as
    plain calls, every parameter's gradient is the model's."""
    pytest.importorskip("transformers")
    source = load_model_file(str(EXAMPLES / "hf_llama.py"))
    model = source.model
    reentrant = {"use_reentrant": True}
    if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.x
        model.activation_checkpointing_enable(reentrant)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reentrant)
    traced = trace(model, source.args, source.kwargs)
    assert [n for n in traced.notes if "checkpoints its own activations" in n]
    model.train()
    model(**source.kwargs).logits.square().mean().backward()  # (reentrant: no .grad())
    want = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    traced.gm(*source.args, **source.kwargs)["logits"].square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, want[name], msg=name)


class SizeCausal(nn.Module):
    """Attention that is causal where there is more than one position, as transformers
    4.57's Falcon and Nemotron decide it (``is_causal=q_len > 1``): a symbolic bool under
    free dimensions, which ``scaled_dot_product_attention`` refuses; a branch on a size:
    export."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x
        b, s, _ = x.shape
        q = x.view(b, s, 2, 4).transpose(1, 2)
        h = nn.functional.scaled_dot_product_attention(q, q, q, is_causal=s > 1)
        return h.transpose(1, 2).reshape(b, s, 8)


def test_a_failed_export_with_free_dimensions_leaves_the_inputs_as_they_were() -> None:
    """That export fails and leaves its dimension marks on the input tensors; the export
    at fixed shapes then traced them symbolic again and failed too. The marks are taken
    off: the model is exported at the example's shapes, with the note saying so."""
    x = torch.randn(2, 6, 8)
    traced = trace(SizeCausal(), (x,), {})
    assert traced.tracer == "export"
    assert [n for n in traced.notes if "could not keep input sizes symbolic" in n]
    assert not [name for name in vars(x) if "dynamo" in name]
    torch.testing.assert_close(traced.gm(x), SizeCausal()(x))


class TorchStack(nn.Module):
    """torch.nn's own stack of transformer layers inside a model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor, causal: bool = False) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1)) if causal else None
        return self.head(self.enc(self.emb(ids), mask=mask))


def test_torch_nn_stacks_of_layers_are_traced_through() -> None:
    """symbolic_trace keeps every torch.nn module as one call: the four layers of an
    nn.TransformerEncoder were one node, which no split could cut between its layers.
    Each layer's ops are now in the graph. Given a mask and no is_causal, the stack
    compares the mask with a causal one (a branch on data, which export cannot take);
    while exporting it detects none, and the frontend gives back is_causal=True for the
    mask of the sizes alone, as the hint would have. The graph computes the model."""
    torch.manual_seed(0)
    model = TorchStack()
    ids = torch.randint(0, 50, (3, 7))
    traced = trace(model, (ids,), {"causal": True})
    stacks = {str(path) for node in traced.gm.graph.nodes
              for path, _ in node.meta.get("nn_module_stack", {}).values()}
    assert {f"enc.layers.{i}" for i in range(4)} <= stacks
    assert not [n for n in traced.gm.graph.nodes if n.op == "call_module" and n.target == "enc"]
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    calls = [n for n in traced.gm.graph.nodes if n.target is sdpa]
    assert len(calls) == 4 and all(c.kwargs.get("is_causal") is True for c in calls)
    want = model(ids, causal=True)
    got = traced.gm(ids, causal=True)
    torch.testing.assert_close(got, want)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(got.square().mean(), params),
                    torch.autograd.grad(want.square().mean(), params), strict=True):
        torch.testing.assert_close(a, b)
