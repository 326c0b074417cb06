"""The gradient a stage sends back is the one the model's backward computes, laid out as
the model lays it out: a float32 sum inside a float64 model then rounds as the model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpipe.runtime import PipelineRunner
from fxpipe.schedules import gpipe, one_f_one_b, zb1p

B, T, HEADS, DIM = 4, 16, 4, 8


class TransposedNorm(nn.Module):
    """Gemma3's query norm, cut after it: a float64 model scales a transposed view of its
    heads in float32, and the next stage reads it through contiguous ops (a rotation made
    with slices and a cat), whose backward makes the gradient contiguous."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.q = nn.Parameter(torch.randn(HEADS * DIM, HEADS * DIM, generator=gen,
                                          dtype=torch.float64) / 8)
        self.scale = nn.Parameter(torch.randn(DIM, generator=gen, dtype=torch.float64))
        self.out = nn.Parameter(torch.randn(HEADS * DIM, 3, generator=gen,
                                            dtype=torch.float64))

    def first(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.q).view(x.shape[0], T, HEADS, DIM).transpose(1, 2)
        return (h.float() * (1.0 + self.scale.float())).type_as(h)  # transposed strides

    def second(self, y: torch.Tensor) -> torch.Tensor:
        rotated = torch.cat((-y[..., DIM // 2:], y[..., :DIM // 2]), dim=-1)
        z = rotated.transpose(1, 2).reshape(y.shape[0], T, HEADS * DIM)
        return torch.tanh(z) @ self.out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class Stage(nn.Module):
    def __init__(self, model: TransposedNorm, part: str, inputs: str, output: str) -> None:
        super().__init__()
        self.model, self.part = model, part
        self.INPUTS, self.OUTPUTS = (inputs,), (output,)

    def forward(self, **values: torch.Tensor) -> tuple[torch.Tensor]:
        return (getattr(self.model, self.part)(values[self.INPUTS[0]]),)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b, zb1p])
def test_a_cut_through_a_transposed_float32_norm_gives_the_models_gradients(schedule) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * B, T, HEADS * DIM, generator=gen, dtype=torch.float64)
    target = torch.randn(2 * B, T, 3, generator=gen, dtype=torch.float64)
    model = TransposedNorm()
    assert not model.first(x).is_contiguous()  # what the second stage receives
    reference = TransposedNorm()
    for xs, ts in zip(x.chunk(2), target.chunk(2), strict=True):  # micro-batch by micro-batch
        (loss_fn(reference(xs), ts) / 2).backward()
    stages = [Stage(model, "first", "x", "y"), Stage(model, "second", "y", "out")]
    runner = PipelineRunner(stages, schedule=schedule(2, 2), microbatches=2,
                            flatten_inputs=lambda x: {"x": x},
                            build_output=lambda values: values["out"])
    runner.step((x,), target, loss_fn)
    for name, p in model.named_parameters():
        want = dict(reference.named_parameters())[name].grad
        assert torch.equal(p.grad, want), (name, (p.grad - want).abs().max().item())
