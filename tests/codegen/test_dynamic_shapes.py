"""Stages that take any batch size and sequence length the model takes.

One split per example model (traced at its example micro-batch of B samples and T
tokens), then ``step`` and ``forward`` at other shapes: micro-batches of 1 to 3B
samples, sequences of T/4 to T tokens, and mini-batches of M + 1 and M - 1 samples
(not a multiple of M, and fewer than M). Each must equal the unsplit model: outputs,
loss and every gradient. The plan (plan.json) and the report name the dimensions
that may vary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from fxpipe.compiler import dynamic_dims
from fxpipe.frontend import InputShape
from fxpipe.plan import Plan
from fxpipe.report import render_report

from ._models import MODELS, assert_runner_matches, import_package, traced, write_package
from ._plans import contiguous_plan

M = 2  # micro-batches per step
# (samples: per micro-batch, in terms of the traced micro-batch's B, or a whole mini-batch
#  of M + 1 / M - 1 samples; sequence length as a fraction of the traced one). A model
#  without a sequence dim takes each size once. The default suite takes three shapes per
#  model (more samples and shorter sequences, an uneven mini-batch, fewer samples than
#  M); the slow tier the grid.
Shape = tuple[str, float]
QUICK: list[Shape] = [("3B", 0.25), ("M+1", 0.5), ("M-1", 1.0)]
PER_MICROBATCH = ("1", "B", "B+1", "2B", "3B")
LENGTHS = (0.25, 0.5, 0.75, 1.0)
GRID: list[Shape] = [(b, t) for b in PER_MICROBATCH for t in LENGTHS]
GRID += [(b, t) for b in ("M+1", "M-1") for t in (0.25, 1.0)]


def mini_batch_rows(size: str, traced_rows: int) -> int:
    """Samples in the mini-batch for a shape's ``size``."""
    if size in ("M+1", "M-1"):
        return M + 1 if size == "M+1" else M - 1
    b = traced_rows
    return M * {"1": 1, "B": b, "B+1": b + 1, "2B": 2 * b, "3B": 3 * b}[size]


# models with a sequence dimension: (input index, dim) of the token dims that vary
SEQUENCE_MODELS = {"gpt", "llama", "hf_gpt2", "hf_llama", "hf_bert", "hf_t5"}


def resized(value: Any, rows: int, lengths: dict[int, int]) -> Any:
    """``value`` with dim 0 cut or repeated to ``rows`` and every dim 1 whose size is a
    key of ``lengths`` cut to its value: the example's own data, so ids stay valid. Copy
    c of the example is rolled by c along its last dim, so that samples differ from one
    micro-batch to the next (a pipeline that swapped or reused micro-batches would not
    match the model)."""

    def resize(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        copies = -(-rows // x.size(0))
        x = torch.cat([x.roll(c, dims=-1) for c in range(copies)])[:rows]
        if x.dim() > 1 and x.size(1) in lengths:
            x = x[:, : lengths[x.size(1)]]
        return x.clone()

    return pytree.tree_map(resize, value)


def sequence_lengths(shapes: tuple[InputShape, ...], fraction: float) -> dict[int, int]:
    """Traced length -> the length to feed, for every token input's free dim 1."""
    return {
        shape.shape[1]: max(1, int(shape.shape[1] * fraction))
        for shape in shapes
        if len(shape.shape) == 2 and shape.dynamic[1] is not None
    }


@pytest.mark.parametrize("name", MODELS)
def test_other_batches_and_sequences_are_transparent(tmp_path: Path, name: str) -> None:
    check_shapes(tmp_path, name, QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_the_grid_of_batches_and_sequences_is_transparent(tmp_path: Path, name: str) -> None:
    check_shapes(tmp_path, name, GRID)


def check_shapes(tmp_path: Path, name: str, shapes: list[Shape]) -> None:
    """One split of example ``name``, then step and forward at each of ``shapes``."""
    source, tr = traced(name)
    if name in SEQUENCE_MODELS:
        assert sequence_lengths(tr.inputs, 1.0), f"{name}: no sequence dim is dynamic"
    else:
        shapes = list(dict.fromkeys((size, 1.0) for size, _ in shapes))
    batched = [s for s in tr.inputs if s.shape]
    assert batched and all(s.dynamic[0] is not None for s in batched), tr.inputs
    plan = contiguous_plan(tr.gm.graph, 3, schedule="1f1b", microbatches=M, model=name,
                           shared_inputs=tr.shared_inputs)
    write_package(tmp_path / "pkg", tr, plan)
    package = import_package(tmp_path / "pkg")
    model = source.model
    runner = package.PipelineRunner(package.build_stages(model))
    for size, fraction in shapes:
        rows = mini_batch_rows(size, batched[0].shape[0])
        lengths = sequence_lengths(tr.inputs, fraction) if name in SEQUENCE_MODELS else {}
        args, kwargs, target = resized((source.args, source.kwargs, source.target), rows, lengths)
        what = f"{name} at {rows} samples, lengths {lengths}"
        assert_runner_matches(runner, model, args, kwargs, target, source.loss_fn, what=what)


def test_a_fixed_dimension_fails_on_entry_naming_both_shapes(tmp_path: Path) -> None:
    source, tr = traced("hf_vit")  # the image size is a constant of the exported graph
    (pixels,) = tr.inputs
    assert pixels.dynamic[0] is not None and pixels.dynamic[2:] == (None, None)
    plan = contiguous_plan(tr.gm.graph, 2, microbatches=M, model="hf_vit")
    write_package(tmp_path / "pkg", tr, plan)
    package = import_package(tmp_path / "pkg")
    runner = package.PipelineRunner(package.build_stages(source.model))
    # the shape passed, not its micro-batches' (2, 3, 64, 64)
    with pytest.raises(ValueError, match=r"Stage0 received 'pixel_values' of shape "
                                         r"\(4, 3, 64, 64\),.*traced with shape \(\*, 3, 32, 32\)"):
        runner.forward(pixel_values=torch.zeros(4, 3, 64, 64))


def test_the_plan_names_the_dynamic_dims() -> None:
    _, tr = traced("hf_llama")
    dims = {(d.input, d.dim): d for d in dynamic_dims(tr)}
    assert set(dims) == {("input_ids", 0), ("input_ids", 1)}
    batch, seq = dims["input_ids", 0], dims["input_ids", 1]
    assert (batch.traced, seq.traced) == tr.inputs[0].shape
    assert seq.low <= seq.traced // 4 and seq.high is None


def test_plan_json_and_the_report_name_the_dynamic_dims() -> None:
    """An exported model's free dims, as ``fxpipe split`` writes them (the compiler puts
    ``dynamic_dims(traced)`` into the plan; tests/test_cli_split.py checks that on a
    symbolically traced model): plan.json round-trips them and the report lists each with
    its traced size and range, and says the cut is costed at the traced shape."""
    _, tr = traced("hf_t5")
    plan = contiguous_plan(tr.gm.graph, 2, microbatches=M, model="hf_t5",
                           dynamic_dims=tuple(dynamic_dims(tr)))
    text = plan.to_json()
    assert Plan.from_json(text).dynamic_dims == plan.dynamic_dims
    assert '"input": "decoder_input_ids"' in text
    line = next(x for x in render_report(plan).splitlines() if x.startswith("- input shapes:"))
    assert line == (
        "- input shapes: dynamic input_ids[0] (traced 2, at least 2), input_ids[1] (traced "
        "32, at least 2), decoder_input_ids[0] (traced 2, at least 2), decoder_input_ids[1] "
        "(traced 16, at least 2); every other dimension fixed at its traced size; costs, "
        "memory and the cut are computed at the traced shape")
