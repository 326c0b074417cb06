"""Generated code means what the graph means: models whose stage lines are long
enough to wrap, functions marked with ``torch.fx.wrap``, the model's own
``torch.autograd.Function``s, constants that ``torch.export`` lifts. Each is split and
compared with the unsplit model (outputs and gradients, float64)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fxpipe.frontend import trace

from ._models import grads, import_package, leaves, ruff, run_stages, write_package
from ._plans import contiguous_plan


def _assert_transparent(tmp_path: Path, model: nn.Module, args: tuple, k: int = 2) -> dict:
    """Split ``model`` into ``k`` stages, run them in sequence, compare with the model;
    returns the generated files."""
    model = model.double()
    args = tuple(a.double() if a.is_floating_point() else a for a in args)
    tr = trace(model, args)
    plan = contiguous_plan(tr.gm.graph, k)
    files = write_package(tmp_path / "pkg", tr, plan)
    assert ruff(tmp_path / "pkg") == ""
    package = import_package(tmp_path / "pkg")
    stages = package.build_stages(model)

    model.zero_grad(set_to_none=True)
    got = run_stages(package, stages, args, {})
    sum(leaf.sum() for leaf in leaves(got)).backward()
    split_grads = grads(model)
    model.zero_grad(set_to_none=True)
    want = model(*args)
    sum(leaf.sum() for leaf in leaves(want)).backward()
    model_grads = grads(model)
    model.zero_grad(set_to_none=True)

    for a, b in zip(leaves(got), leaves(want), strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert sorted(split_grads) == sorted(model_grads)
    for key, value in model_grads.items():
        assert torch.equal(split_grads[key], value), key
    return files


class _Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.final_layer_normalization_of_the_encoder_stack_out = nn.LayerNorm(6)


class ClsPooling(nn.Module):
    """A CLS-token pooling ``h[:, 0]`` read from a module with a long dotted name: the
    index line is longer than the line length."""

    def __init__(self, index: tuple) -> None:
        super().__init__()
        self.index = index
        self.vision_transformer_backbone = _Backbone()
        self.embed = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.vision_transformer_backbone.final_layer_normalization_of_the_encoder_stack_out(h)
        return self.head(h[self.index])


@pytest.mark.parametrize(
    "index", [(slice(None), 0), (1, 0)], ids=["cls-token", "integers-only"]
)
def test_a_wrapped_index_selects_the_same_elements(tmp_path: Path, index: tuple) -> None:
    torch.manual_seed(0)
    files = _assert_transparent(tmp_path, ClsPooling(index), (torch.randn(3, 5, 4),))
    text = files["stage0.py"] + files["stage1.py"]
    long_name = "vision_transformer_backbone_final_layer_normalization_of_the_encoder_stack_out"
    assert f"{long_name}[" in text  # the line that has to wrap is there
    assert all(len(line) <= 100 or line.endswith("# noqa: E501") for line in text.splitlines())


MODEL_FILE = '''
import torch
from torch import nn

from tests.codegen._wrapped import Residual


@torch.fx.wrap
def drop_path(x, p: float, training: bool):
    if not training or p == 0.0:
        return x
    keep = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
    return x * keep / (1.0 - p)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.block = Residual(6, 0.5)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = drop_path(self.embed(x), 0.25, self.training)
        h = self.block(torch.relu(h))
        return self.head(drop_path(h, 0.5, self.training))


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(3, 4),)
'''


@pytest.mark.parametrize("k", [2, 3])
def test_functions_marked_with_fx_wrap_are_called_by_name(tmp_path: Path, k: int) -> None:
    from fxpipe.frontend import load_model_file

    (tmp_path / "model.py").write_text(MODEL_FILE, encoding="utf-8")
    source = load_model_file(str(tmp_path / "model.py"))
    files = _assert_transparent(tmp_path, source.model, source.args, k)
    text = "".join(v for name, v in files.items() if name.startswith("stage"))
    assert "torch.fx._symbolic_trace.wrap" not in text
    # the node is named scaled_residual too: the library function is imported under
    # another name (its module's path may name something else, see below)
    assert "\nfrom tests.codegen._wrapped import scaled_residual as scaled_residual_function\n" \
        in text
    assert "= scaled_residual_function(" in text
    assert "self.drop_path(" in text
    assert 'self.drop_path = type(model).forward.__globals__["drop_path"]' in text


FUNCTIONS_FILE = '''
import torch
from torch import nn

from tests.codegen._wrapped import Quantized

BRANCH = False


class Reverse(torch.autograd.Function):
    """A gradient reversal layer: identity forward, the gradient negated and scaled."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class Pair(torch.autograd.Function):
    """Two outputs, a saved input, a backward of its own."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.round(), x * 2

    @staticmethod
    def backward(ctx, grad_rounded, grad_doubled):
        (x,) = ctx.saved_tensors
        return grad_rounded * x.sign() + 2 * grad_doubled


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.quantized = Quantized(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        if BRANCH and x.shape[0] == 0:  # a branch on a size: torch.export traces it
            return x
        h = Reverse.apply(torch.tanh(self.a(x)), 0.5)
        rounded, doubled = Pair.apply(self.quantized(h))
        return self.head(rounded + doubled)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(3, 4),)
'''


@pytest.mark.parametrize(("k", "tracer"), [(2, "symbolic_trace"), (4, "symbolic_trace"),
                                         (3, "export")])
def test_the_models_own_autograd_functions_run_their_backward(tmp_path: Path, k: int,
                                                              tracer: str) -> None:
    """Each call of a Function of the model file or of a library is one node that the stage
    calls as ``TheFunction.apply``, so the stages' gradients are the model's (reversed,
    straight through, of two outputs), not the derivative of the Function's forward."""
    from fxpipe.frontend import load_model_file

    branch = f"BRANCH = {tracer == 'export'}"
    (tmp_path / "model.py").write_text(FUNCTIONS_FILE.replace("BRANCH = False", branch),
                                       encoding="utf-8")
    source = load_model_file(str(tmp_path / "model.py"))
    traced = trace(source.model.double(), tuple(a.double() for a in source.args))
    assert traced.tracer == tracer
    assert not [n for n in traced.notes if "autograd.Function" in n], traced.notes
    files = _assert_transparent(tmp_path, source.model, source.args, k)
    text = "".join(v for name, v in files.items() if name.startswith("stage"))
    assert 'self.Reverse = type(model).forward.__globals__["Reverse"]' in text
    assert "= self.Reverse.apply(tanh, 0.5)" in text
    assert "= self.Pair.apply(" in text
    assert "\nfrom tests.codegen._wrapped import StraightThrough\n" in text
    assert "= StraightThrough.apply(" in text


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x)) + x


class HookedBlocks(nn.Module):
    """Blocks whose backward hooks change the gradient: one scales what flows into the
    block, one masks what flows out of a Linear inside another."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.blocks[1].register_full_backward_hook(lambda m, gi, go: (gi[0] * -0.5,))
        self.blocks[2].inner.register_full_backward_pre_hook(lambda m, go: (go[0] * 3,))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("k", [2, 4])
def test_modules_with_backward_hooks_are_called_by_the_stages(tmp_path: Path, k: int) -> None:
    """symbolic_trace keeps a module with backward hooks as one call: the stage calls the
    model's module, whose hooks run, so the gradients are the model's."""
    torch.manual_seed(0)
    model, x = HookedBlocks(), torch.randn(3, 6)
    traced = trace(model, (x,))
    assert {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_module"} >= {
        "blocks.1", "blocks.2.inner"}
    assert not [n for n in traced.notes if "hook" in n], traced.notes
    files = _assert_transparent(tmp_path, model, (x,), k)
    text = "".join(v for name, v in files.items() if name.startswith("stage"))
    assert "self.blocks[1](" in text


class ShadowedBlocks(nn.Module):
    """Residual blocks with stochastic depth from a package that hides the function's
    module behind the function (torchvision's efficientnet and convnext)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.codegen._ops import StochasticDepth

        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.drop = nn.ModuleList(StochasticDepth(p) for p in (0.0, 0.1, 0.2, 0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, drop in zip(self.blocks, self.drop, strict=True):
            x = x + drop(torch.tanh(block(x)))
        return x


@pytest.mark.parametrize("k", [2, 3])
def test_a_wrapped_function_whose_module_is_hidden_by_its_package(tmp_path: Path,
                                                                   k: int) -> None:
    import tests.codegen._ops

    assert not isinstance(tests.codegen._ops.stochastic_depth, type(tests))  # the layout
    torch.manual_seed(0)
    files = _assert_transparent(tmp_path, ShadowedBlocks(), (torch.randn(3, 6),), k)
    text = "".join(v for name, v in files.items() if name.startswith("stage"))
    assert "tests.codegen._ops.stochastic_depth.stochastic_depth(" not in text
    assert "from tests.codegen._ops.stochastic_depth import stochastic_depth" in text


def test_constants_lifted_by_export_are_ops_of_the_stage(tmp_path: Path) -> None:
    """Falcon's attention builds ``torch.tensor([-2])`` in forward; export lifts it to
    an attribute that is neither a parameter nor a buffer. The pipeline trains it
    transparently: loss, outputs and gradients of ``step`` equal the model's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FalconConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        new_decoder_architecture=False, multi_query=True, alibi=False, use_cache=False,
    )
    model = transformers.FalconForCausalLM(config).double()
    inputs = {"input_ids": torch.randint(0, 64, (2, 6))}
    tr = trace(model, (), inputs)
    assert tr.tracer == "export"
    assert not any("lifted_tensor" in str(n.target) for n in tr.gm.graph.nodes)
    plan = contiguous_plan(tr.gm.graph, 3, schedule="1f1b", microbatches=2)
    files = write_package(tmp_path / "pkg", tr, plan)
    assert "torch.tensor([-2], dtype=torch.int64, device=stage_device)" in "".join(files.values())
    assert ruff(tmp_path / "pkg") == ""
    package = import_package(tmp_path / "pkg")
    runner = package.PipelineRunner(package.build_stages(model))

    def loss_fn(output: dict, target: object) -> torch.Tensor:
        return output["logits"].pow(2).mean()

    batch = {"input_ids": torch.randint(0, 64, (4, 6))}
    model.zero_grad(set_to_none=True)
    loss = runner.step(batch, None, loss_fn)
    pipeline_grads = grads(model)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        pipeline_out = runner.forward(**batch)
    want = model(**batch)
    want_loss = loss_fn(want, None)
    want_loss.backward()
    model_grads = grads(model)
    model.zero_grad(set_to_none=True)

    torch.testing.assert_close(torch.as_tensor(loss), want_loss.detach())
    torch.testing.assert_close(pipeline_out["logits"], want["logits"].detach())
    assert sorted(pipeline_grads) == sorted(model_grads)
    for key, value in model_grads.items():
        torch.testing.assert_close(pipeline_grads[key], value, msg=lambda m, key=key: f"{key}: {m}")


class Indexed(nn.Module):
    """Children the model reaches by index: a ModuleList of Sequentials, a ModuleDict whose
    keys are not identifiers, a ParameterList read directly."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.heads = nn.ModuleDict({"out-1": nn.Linear(6, 6), "01": nn.Linear(6, 3)})
        self.scales = nn.ParameterList(nn.Parameter(torch.randn(6)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x) * self.scales[i % 2]
        return self.heads["01"](self.heads["out-1"](x))


@pytest.mark.parametrize("k", [2, 3])
def test_children_are_reached_by_index_as_the_model_does(tmp_path: Path, k: int) -> None:
    torch.manual_seed(0)
    files = _assert_transparent(tmp_path, Indexed(), (torch.randn(4, 6),), k)
    text = "".join(v for name, v in files.items() if name.startswith("stage"))
    assert "self.blocks[0][0](x)" in text
    assert "self.blocks[2][1](" in text
    assert "scales_0 = self.scales[0]" in text
    assert 'self.heads["out-1"](' in text and 'self.heads["01"](' in text
    for by_name in ("getattr(", "get_submodule(", "get_parameter(", "get_buffer("):
        assert by_name not in text


class Numbered(nn.Module):
    """Children named by numbers at the top, as in a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("0", nn.Linear(6, 6))
        self.add_module("1", Indexed())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "1")(getattr(self, "0")(x))


def test_the_stage_itself_is_not_indexed(tmp_path: Path) -> None:
    """The model's own children are the stage's, and the stage class is a plain module,
    so it reads them by name; what it holds below them indexes."""
    torch.manual_seed(0)
    files = _assert_transparent(tmp_path, Numbered(), (torch.randn(4, 6),), 2)
    text = "".join(v for name, v in files.items() if name.startswith("stage"))
    assert 'self.get_submodule("0")(x)' in text
    assert 'self.get_submodule("1").blocks[0][0](' in text
    assert "getattr(" not in text
