"""A model file loaded by path under a module name that is not in ``sys.modules`` (as a
notebook or a test harness loads one with importlib): the stages find the file's
``torch.fx.wrap`` functions and autograd.Functions through the model's classes, not by
the module's name, so the package builds and trains whichever way the file was loaded
(it bound ``sys.modules[type(model).__module__].fn``, a KeyError there)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from fxpipe.codegen.wrapped import importable

from .test_meaning import _assert_transparent

MODEL_FILE = '''
import torch
from torch import nn

BRANCH = False


@torch.fx.wrap
def drop_path(x, p: float, training: bool):
    if not training or p == 0.0:
        return x
    return x * 2.0


class Reverse(torch.autograd.Function):
    """A gradient reversal layer: its backward is not its forward's derivative."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        if BRANCH and x.shape[0] == 0:  # a branch on a size: torch.export traces it
            return x
        h = drop_path(torch.relu(self.embed(x)), 0.25, self.training)
        h = Reverse.apply(torch.tanh(self.mid(h)), 0.5)
        return self.head(drop_path(h, 0.5, self.training))
'''


@pytest.mark.parametrize(("k", "tracer"), [(2, "symbolic_trace"), (3, "symbolic_trace"),
                                         (2, "export")])
def test_a_model_file_loaded_under_an_unregistered_name(tmp_path: Path, k: int,
                                                        tracer: str) -> None:
    path = tmp_path / "harness_model.py"
    path.write_text(MODEL_FILE.replace("BRANCH = False", f"BRANCH = {tracer == 'export'}"),
                    encoding="utf-8")
    name = f"harness_model_{tracer}_{k}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # never registered in sys.modules
    assert name not in sys.modules and not importable(name)
    torch.manual_seed(0)
    files = _assert_transparent(tmp_path, module.Net(), (torch.randn(3, 4),), k)
    text = "".join(v for file, v in files.items() if file.startswith("stage"))
    assert name not in text and "sys.modules" not in text
    assert 'self.Reverse = type(model).forward.__globals__["Reverse"]' in text
    if tracer == "symbolic_trace":
        assert 'self.drop_path = type(model).forward.__globals__["drop_path"]' in text


def test_importable_tells_a_module_the_import_system_finds() -> None:
    assert importable("tests.codegen._wrapped") or "tests.codegen._wrapped" not in sys.modules
    assert importable("torch.nn.functional")
    assert not importable("__main__")
    assert not importable("no_such_module_anywhere")
