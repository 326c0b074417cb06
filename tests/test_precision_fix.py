"""When no split fits, the error names a leaner --precision only when a split at it fits:
found by costing the graph at that precision, and checked here by splitting at it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from fxpipe.compiler import SplitOptions, analyze_file, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import ModelSource, Traced
from fxpipe.partition import InfeasibleMemoryError
from fxpipe.precision import Precision
from fxpipe.units import parse_bytes
from tests.test_error_table import DEEP, WIDE

# WIDE: activations dominate, and bfloat16 activations halve what a stage keeps per
# micro-batch. DEEP: parameters dominate, autocast's weight copies make bf16-mixed need
# more than float32, and only bf16-true (half the parameters and Adam's state) fits.


def _split(tmp_path: Path, body: str, memory: str, precision: Precision | None = None
           ) -> tuple[ModelSource, Traced, SplitOptions]:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(body))
    device = get_device("h100")
    source, traced = analyze_file(str(path), device=device, precision=precision)
    options = SplitOptions(gpus=2, device=device, memory_limit=float(parse_bytes(memory)),
                           microbatches=8, precision=precision)
    return source, traced, options


def _error(tmp_path: Path, body: str, memory: str, precision: Precision | None = None
           ) -> InfeasibleMemoryError:
    source, traced, options = _split(tmp_path, body, memory, precision)
    before = {node.name: dict(node.meta) for node in traced.gm.graph.nodes}
    with pytest.raises(InfeasibleMemoryError) as caught:
        plan_split(traced, label=source.label, options=options)
    # the graph keeps the annotations of the precision it was analysed at
    after = {node.name: dict(node.meta) for node in traced.gm.graph.nodes}
    assert after.keys() == before.keys()
    for name, meta in before.items():
        assert after[name].keys() == meta.keys(), name
        assert all(after[name][key] is value for key, value in meta.items()), name
    # and the model's parameters stay as analysed: float32, or cast for a *-true precision
    dtype = precision.dtype if precision is not None and not precision.mixed else torch.float32
    assert all(p.dtype == dtype for p in traced.gm.parameters())
    return caught.value


def _fits(tmp_path: Path, body: str, memory: str, precision: Precision) -> bool:
    source, traced, options = _split(tmp_path, body, memory, precision)
    try:
        plan = plan_split(traced, label=source.label, options=options)
    except InfeasibleMemoryError:
        return False
    assert plan.precision == precision.value
    return True


def test_bf16_mixed_is_named_when_a_split_at_it_fits(tmp_path: Path) -> None:
    error = _error(tmp_path, WIDE, "5MiB")
    assert error.precision == "bf16-mixed"
    assert "train at precision bf16-mixed" in str(error)
    assert _fits(tmp_path, WIDE, "5MiB", Precision.BF16_MIXED)


def test_bf16_true_is_named_when_only_it_fits(tmp_path: Path) -> None:
    error = _error(tmp_path, DEEP, "3MiB")
    assert error.precision == "bf16-true"
    assert error.fits_on == 4
    assert not _fits(tmp_path, DEEP, "3MiB", Precision.BF16_MIXED)
    assert _fits(tmp_path, DEEP, "3MiB", Precision.BF16_TRUE)


def test_no_precision_is_named_when_none_fits(tmp_path: Path) -> None:
    assert _error(tmp_path, WIDE, "1MiB").precision is None
    assert not _fits(tmp_path, WIDE, "1MiB", Precision.BF16_TRUE)


def test_a_bf16_true_plan_has_no_leaner_precision(tmp_path: Path) -> None:
    error = _error(tmp_path, DEEP, "1MiB", Precision.BF16_TRUE)
    assert error.precision is None


def test_a_precision_the_passes_cannot_run_is_not_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph the passes cannot analyse at bf16-mixed goes on to the next leaner
    precision instead of failing the error."""
    import fxpipe.advice
    from fxpipe.kernels import Execution
    from fxpipe.passes import AnalysisError

    annotate_memory = fxpipe.advice.annotate_memory

    def failing(gm: torch.fx.GraphModule, *inputs: object, execution: Execution,
                shapes: bool) -> object:
        if execution.precision is Precision.BF16_MIXED:
            raise AnalysisError("memory accounting failed at %linear")
        return annotate_memory(gm, *inputs, execution=execution, shapes=shapes)

    source, traced, options = _split(tmp_path, WIDE, "5MiB")
    monkeypatch.setattr(fxpipe.advice, "annotate_memory", failing)
    with pytest.raises(InfeasibleMemoryError) as caught:
        plan_split(traced, label=source.label, options=options)
    assert caught.value.precision == "bf16-true"
