"""Generated stages run where they are placed, and wide schedules still pass ruff."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from fxpipe.compiler import SplitOptions, analyze, output_files, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import load_model_file, trace_source
from fxpipe.output import write_folder

from ._models import import_package, ruff

ROOT = Path(__file__).resolve().parents[2]


def split(example: str, out: Path, *, gpus: int, microbatches: int) -> Path:
    source = load_model_file(str(ROOT / "examples" / example))
    traced = trace_source(source)
    device = get_device("h100")
    analyze(traced, device=device)
    options = SplitOptions(gpus=gpus, device=device, memory_limit=float("inf"),
                           microbatches=microbatches)
    plan = plan_split(traced, label=example, options=options)
    write_folder(out, output_files(traced, plan, label=example))
    return out


def test_export_stages_follow_their_device_instead_of_the_tracing_one(tmp_path: Path) -> None:
    # torch.export wrote device=cpu into the rotary-embedding aranges of HF Llama.
    out = split("hf_llama.py", tmp_path / "llama", gpus=2, microbatches=2)
    sources = "".join(p.read_text() for p in sorted(out.glob("stage*.py")))
    assert "stage_device" in sources and "device(type=" not in sources
    package = import_package(out)
    source = load_model_file(str(ROOT / "examples" / "hf_llama.py"))
    first = package.build_stages(source.model)[0].to("meta")
    values = package.runner.flatten_inputs(**source.kwargs)
    inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), values)
    outputs = first(**{name: inputs[name] for name in first.INPUTS})
    assert all(t.is_meta for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor))


def test_a_wide_schedule_still_passes_ruff(tmp_path: Path) -> None:
    out = split("mlp.py", tmp_path / "mlp", gpus=3, microbatches=16)
    runner = (out / "runner.py").read_text()
    assert "tick    | " in runner  # the picture wrapped into blocks of ticks
    assert ruff(out) == ""
