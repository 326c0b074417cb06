"""Transparency at the plan's precision: the generated runner under ``bf16-mixed`` gives
the outputs, loss and gradients of the unsplit model run under the same CPU autocast,
at bfloat16's tolerance; ``16-mixed`` scales the loss with a GradScaler; under
``bf16-true`` and ``16-true`` the stages of the model cast with ``model.to(dtype)`` give
what that cast model gives."""

from __future__ import annotations

import contextlib
import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fxpipe.compiler import analyze_file
from fxpipe.cost_models import get_device
from fxpipe.frontend import load_model_file, trace
from fxpipe.precision import parse_precision

from ._models import (
    EXAMPLES,
    grads,
    import_file,
    import_package,
    leaves,
    mini_batch,
    traced,
    write_package,
)
from ._plans import contiguous_plan

# bfloat16 keeps 8 bits of mantissa (eps 2^-8): values that went through a few bf16 ops
# on different micro-batch groupings agree to about 1%; a gradient is compared against
# its own largest entry, since rounding errors are relative to the sums that made them.
RTOL = 2e-2


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    scale = want.detach().abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got.detach(), want.detach(), rtol=RTOL, atol=RTOL * scale,
                               msg=lambda m: f"{what}: {m}")


def _both(runner: Any, model: torch.nn.Module, source: Any,
          context: contextlib.AbstractContextManager[Any]) -> tuple[Any, ...]:
    """One mini-batch of ``source`` through the runner (``step``: loss and gradients,
    ``forward``: outputs) and through the model in ``context``: the runner's loss, outputs
    and gradients, then the model's."""
    args, kwargs = mini_batch(source.args), mini_batch(source.kwargs)
    target = mini_batch(source.target)
    model.zero_grad(set_to_none=True)
    loss = runner.step(kwargs if kwargs else args, target, source.loss_fn)
    pipeline_grads = grads(model)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        pipeline_out = runner.forward(*args, **kwargs)
    with context:
        want = model(*args, **kwargs)
        want_loss = source.loss_fn(want, target)
    want_loss.backward()
    model_grads = grads(model)
    model.zero_grad(set_to_none=True)
    return loss, pipeline_out, pipeline_grads, want, want_loss, model_grads


def _package(tmp_path: Path, name: str, precision: str, recompute: bool | str) -> Any:
    _source, tr = traced(name)
    k = 3
    plan = contiguous_plan(tr.gm.graph, k, schedule="1f1b", microbatches=2,
                           recompute=(recompute,) * k, model=name)
    files = write_package(tmp_path / "pkg", tr, dataclasses.replace(plan, precision=precision))
    assert f'PRECISION = "{precision}"' in files["runner.py"]
    return import_package(tmp_path / "pkg")


# "selective:128:32" keeps the HF Llama's down projection (2 x 176 FLOPs per element),
# attention and key and value projections (2 x 64 into 32 columns), and runs its query,
# output, gate, up and LM head matmuls again
@pytest.mark.parametrize(("name", "recompute"),
                         [("llama", False), ("llama", True), ("hf_llama", True),
                          ("hf_llama", "selective"), ("hf_llama", "selective:128:32")])
def test_bf16_mixed_runner_matches_the_model_under_autocast(
    tmp_path: Path, name: str, recompute: bool | str
) -> None:
    source, _tr = traced(name)
    package = _package(tmp_path, name, "bf16-mixed", recompute)
    model = source.model
    runner = package.PipelineRunner(package.build_stages(model))
    assert runner.precision == "bf16-mixed" and runner.scaler is None

    loss, pipeline_out, pipeline_grads, want, want_loss, model_grads = _both(
        runner, model, source, torch.autocast("cpu", dtype=torch.bfloat16))

    _close(torch.as_tensor(loss), want_loss, "loss")
    out_leaves = leaves(pipeline_out)
    # the model's output under autocast is bfloat16: a runner without autocast would not be
    assert any(t.dtype == torch.bfloat16 for t in leaves(want))
    for a, b in zip(out_leaves, leaves(want), strict=True):
        _close(a, b, "output")
    assert sorted(pipeline_grads) == sorted(model_grads)
    for key, value in model_grads.items():
        assert pipeline_grads[key].dtype == torch.float32, key  # fp32 parameters and grads
        _close(pipeline_grads[key], value, key)


def test_16_mixed_runner_scales_the_loss(tmp_path: Path) -> None:
    """The runner's GradScaler (on the CPU: ``torch.amp.GradScaler("cpu")``) scales the
    gradients backward leaves, and steps an optimizer as it would for the unsplit model."""
    source, _tr = traced("llama")
    package = _package(tmp_path, "llama", "16-mixed", False)
    model = source.model
    runner = package.PipelineRunner(package.build_stages(model))
    assert isinstance(runner.scaler, torch.amp.GradScaler)
    scale = runner.scaler.get_scale()
    assert scale > 1

    args, target = mini_batch(source.args), mini_batch(source.target)
    model.zero_grad(set_to_none=True)
    runner.step(args, target, source.loss_fn)
    pipeline_grads = grads(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        want_loss = source.loss_fn(model(*args), target)  # type: ignore[misc]
    (want_loss * scale).backward()
    model_grads = grads(model)
    model.zero_grad(set_to_none=True)
    for key, value in model_grads.items():
        _close(pipeline_grads[key], value, key)

    # unscaled, the gradients are the unsplit model's; no inf was found, so the scale stays
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.0)  # the shared model keeps its weights
    runner.step(args, target, source.loss_fn)
    runner.scaler.unscale_(optimizer)
    for key, p in model.named_parameters():
        if key in model_grads:
            _close(p.grad, model_grads[key] / scale, key)
    runner.scaler.step(optimizer)
    runner.scaler.update()
    assert runner.scaler.get_scale() == scale
    model.zero_grad(set_to_none=True)

# transformers' Mistral at toy size: Llama's layers with a sliding attention window
MISTRAL = f"""
    import sys
    sys.path.insert(0, {str(EXAMPLES)!r})
    import torch
    from transformers import MistralConfig, MistralForCausalLM
    from transformers_models import llama_inputs as example_inputs
    from transformers_models import llama_target as example_target
    from transformers_models import loss_fn

    def build_model():
        torch.manual_seed(0)
        config = MistralConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            sliding_window=8, attention_dropout=0.0, use_cache=False, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
        return MistralForCausalLM(config).train()
"""


def _model_file(tmp_path: Path, name: str) -> str:
    if name == "hf_mistral":
        path = tmp_path / "hf_mistral.py"
        path.write_text(textwrap.dedent(MISTRAL))
        return str(path)
    return str(EXAMPLES / f"{name}.py")


@pytest.mark.parametrize(("name", "precision"), [
    ("hf_llama", "bf16-true"), ("hf_llama", "16-true"), ("hf_gpt2", "bf16-true"),
    ("hf_mistral", "bf16-true")])
def test_true_precision_runner_matches_the_cast_model(tmp_path: Path, name: str,
                                                      precision: str) -> None:
    """transformers' models keep some values in float32 whatever the model's dtype (the
    rotary embedding's cos and sin, RMSNorm's variance) and cast others back to the dtype
    of their input, which torch.export writes into the graph as the dtype it traced: the
    file's model is traced cast, as it will train, and its stages run on the cast model."""
    spec = _model_file(tmp_path, name)
    dtype = parse_precision(precision).dtype
    _source, tr = analyze_file(spec, device=get_device("cpu"),
                               precision=parse_precision(precision))
    assert tr.tracer == "export"
    plan = contiguous_plan(tr.gm.graph, 3, schedule="1f1b", microbatches=2, model=name)
    write_package(tmp_path / "pkg", tr, dataclasses.replace(plan, precision=precision))
    package = import_package(tmp_path / "pkg")

    fresh = load_model_file(spec)  # what a user builds, and casts before build_stages
    model = fresh.model.to(dtype)
    runner = package.PipelineRunner(package.build_stages(model))
    loss, pipeline_out, pipeline_grads, want, want_loss, model_grads = _both(
        runner, model, fresh, contextlib.nullcontext())

    _close(torch.as_tensor(loss), want_loss, "loss")
    assert [t.dtype for t in leaves(want)] == [dtype]
    for a, b in zip(leaves(pipeline_out), leaves(want), strict=True):
        _close(a, b, "output")
    assert sorted(pipeline_grads) == sorted(model_grads)
    for key, value in model_grads.items():
        assert pipeline_grads[key].dtype == dtype, key
        _close(pipeline_grads[key], value, key)


def test_true_precision_warns_on_an_uncast_model(tmp_path: Path) -> None:
    source, _tr = traced("mlp")
    package = _package(tmp_path, "mlp", "bf16-true", False)
    with pytest.warns(UserWarning, match=r"model\.to\(torch\.bfloat16\)"):
        package.PipelineRunner(package.build_stages(source.model))


@pytest.mark.parametrize(("precision", "sent"), [("bf16-mixed", torch.bfloat16),
                                                 ("32-true", torch.float32)])
def test_torchrun_stages_send_at_the_autocast_dtype(tmp_path: Path, precision: str,
                                                    sent: torch.dtype) -> None:
    """Under torchrun, torch's PipelineStage sends and receives at the dtypes of the
    example run: under bf16-mixed a stage's matmul output crosses as bfloat16, as the
    stage forward (run under the autocast) makes it (tests/distributed runs it)."""
    source, _tr = traced("mlp")
    package = _package(tmp_path, "mlp", precision, False)
    adapter, _inputs, outputs = package.distributed.stage_module(source.model, 0, "cpu",
                                                                 *source.args)
    assert adapter.precision == precision
    assert [y.dtype for y in outputs] == [sent] * len(outputs)
    with torch.no_grad():
        real = adapter(*source.args)
    assert [y.dtype for y in real] == [y.dtype for y in outputs]


# Python that reads the dtype autocast gives a value: what torch.export writes into the
# graph is the branch and the cast it traced (T5 clamps float16 values; an RMSNorm casts
# back to its input's dtype).
DTYPE_READER = """
    import torch
    from torch import nn


    class Norm(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

        def forward(self, x):
            dtype = x.dtype
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * y.to(dtype)


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 32)
            self.norm = Norm(32)
            self.down = nn.Linear(32, 16)

        def forward(self, x):
            h = self.up(x)
            if h.dtype == torch.bfloat16:  # symbolic_trace cannot branch on it: export
                h = h.clamp(-0.5, 0.5)
            return self.down(self.norm(h))


    def build_model():
        torch.manual_seed(0)
        return Model()


    def example_inputs():
        return (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)) * 4,)


    def loss_fn(output, target):
        return output.float().pow(2).mean()
"""


def test_bf16_mixed_is_traced_as_autocast_runs_the_model(tmp_path: Path) -> None:
    """``--precision bf16-mixed`` traces the model under autocast: the stages take the
    branch and the casts the model takes under it, so the pipeline's forward is the
    model's bit for bit (a trace at float32 skipped the clamp: outputs 2x off)."""
    spec = tmp_path / "dtype_reader.py"
    spec.write_text(textwrap.dedent(DTYPE_READER))
    source, tr = analyze_file(str(spec), device=get_device("cpu"),
                              precision=parse_precision("bf16-mixed"))
    assert tr.tracer == "export"
    plan = contiguous_plan(tr.gm.graph, 2, schedule="1f1b", microbatches=2, model="reader")
    write_package(tmp_path / "pkg", tr, dataclasses.replace(plan, precision="bf16-mixed"))
    package = import_package(tmp_path / "pkg")
    model = load_model_file(str(spec)).model
    runner = package.PipelineRunner(package.build_stages(model))

    (x,) = mini_batch(source.args)
    with torch.no_grad():
        got = runner.forward(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = model(x)
            at_float32 = model.down(model.norm(model.up(x)))  # the branch not taken
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert not torch.allclose(got.float(), at_float32.float(), rtol=RTOL, atol=RTOL)

    # the step's gradients too, against the model micro-batch by micro-batch
    runner.step((x,), None, source.loss_fn)
    pipeline_grads = grads(model)
    model.zero_grad(set_to_none=True)
    for micro in x.chunk(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = source.loss_fn(model(micro), None) / 2
        loss.backward()
    model_grads = grads(model)
    assert sorted(pipeline_grads) == sorted(model_grads)
    for key, value in model_grads.items():
        assert torch.equal(pipeline_grads[key], value), key


def test_a_meta_model_traced_for_autocast_says_what_it_cannot_trace(tmp_path: Path) -> None:
    """Autocast does not run on the meta device, so a model built there is traced at its
    own dtype; the note says so and what to do."""
    spec = tmp_path / "dtype_reader.py"
    spec.write_text(textwrap.dedent(DTYPE_READER))
    module = import_file(spec)
    with torch.device("meta"):
        model = module.build_model()
    tr = trace(model, module.example_inputs(), autocast=torch.bfloat16)
    assert tr.tracer == "export"
    assert any("meta device, where autocast does not run" in note and "on the CPU" in note
               for note in tr.notes), tr.notes
    on_cpu = trace(module.build_model(), module.example_inputs(), autocast=torch.bfloat16)
    assert not any("meta device" in note for note in on_cpu.notes)


class _TwoReaders(nn.Module):
    """A float32 value (bfloat16 matmul output times a float32 weight) that two matmuls of
    the next stage read."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 32))
        self.left = nn.Linear(32, 8)
        self.right = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x)) * self.scale
        return self.left(h) + self.right(h)


def test_bf16_mixed_stages_sum_a_received_values_gradients_as_the_model(tmp_path: Path) -> None:
    """Autocast caches its cast of a float32 leaf that requires grad: a received value is
    one, so the two matmuls reading it shared one bfloat16 copy and backward summed their
    gradients in bfloat16. In the model that value is an activation, cast per matmul and
    its gradients summed in float32. The stages now read it as the model does, in one
    process and as torchrun's stages, and give the model's gradients bit for bit."""
    torch.manual_seed(0)
    model, x = _TwoReaders(), torch.randn(4, 16)
    tr = trace(model, (x,))
    plan = contiguous_plan(tr.gm.graph, 2, schedule="1f1b", microbatches=2, model="readers")
    assert [len(s.nodes) for s in plan.stages] == [4, 3]  # the cut right after the scale
    write_package(tmp_path / "pkg", tr, dataclasses.replace(plan, precision="bf16-mixed"))
    package = import_package(tmp_path / "pkg")

    def loss_fn(output: torch.Tensor, target: Any) -> torch.Tensor:
        return output.float().pow(2).mean()

    model.zero_grad(set_to_none=True)
    for micro in x.chunk(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(micro), None) / 2
        loss.backward()
    want = grads(model)
    model.zero_grad(set_to_none=True)
    runner = package.PipelineRunner(package.build_stages(model))
    runner.step((x,), None, loss_fn)
    assert sorted(grads(model)) == sorted(want)
    for key, value in grads(model).items():
        assert torch.equal(value, want[key]), key

    # torchrun's stages: each a StageAdapter, chained on one micro-batch
    model.zero_grad(set_to_none=True)
    micro = x[:2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model(micro), None)
    loss.backward()
    want = grads(model)
    adapters = [package.distributed.stage_module(model, k, "cpu", micro)[0] for k in range(2)]
    model.zero_grad(set_to_none=True)
    flat: tuple[torch.Tensor, ...] = (micro,)
    for adapter in adapters:
        flat = tuple(y.detach().requires_grad_(y.is_floating_point()) for y in flat)
        received = flat
        out = adapter(*flat)
        flat = out if isinstance(out, tuple) else (out,)
        if adapter is adapters[0]:
            sent = flat
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(flat[0], None)
    loss.backward()
    torch.autograd.backward(sent, [r.grad for r in received])
    got = {name: p.grad for adapter in adapters
           for name, p in adapter.stage.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(want)
    for key, value in got.items():
        assert torch.equal(value, want[key]), key

