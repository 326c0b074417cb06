"""Models built on the meta device trace and profile without allocating their weights.

``build_gpt_1p5b`` (48 x 1600, ~1.56B parameters, 6.2 GB of float32 weights if they
existed) takes ~12 s in-process on a 2-core CPU; GPT-2 small on meta (124M
parameters) checks the same path in ~2 s.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.export  # import the tracer's dependencies before measuring memory

from fxpipe.cost_models import analytic, get_device
from fxpipe.frontend import load_model_file, trace
from fxpipe.passes import annotate_all
from fxpipe.profile import summarize

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
GIB = 2**30


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def profile_on_meta(factory: str) -> tuple[int, int, int]:
    """(parameter count, summary parameter bytes, RSS growth in bytes) of one factory."""
    import torch._dynamo  # noqa: F401  # one-time import cost, not the model's

    before = rss_bytes()
    source = load_model_file(f"{GPT}:{factory}")
    traced = trace(source.model, source.args, source.kwargs)
    annotate_all(traced.gm, *traced.flat_inputs)
    analytic.annotate_times(traced.gm, get_device("h100"))
    _, total = summarize(traced.gm)
    growth = rss_bytes() - before
    print(f"{factory}: {len(traced.gm.graph.nodes)} nodes, RSS +{growth / 2**20:.0f} MiB")

    state = [*source.model.parameters(), *source.model.buffers()]
    state += [*traced.gm.parameters(), *traced.gm.buffers()]
    materialized = [tuple(t.shape) for t in state if not t.is_meta]
    assert not materialized, f"tensors with storage: {materialized[:5]}"
    assert total.flops_forward > 0
    count = sum(p.numel() for p in source.model.parameters())
    assert total.param_bytes == 4 * count
    return count, total.param_bytes, growth


def test_gpt_1p5b_on_meta_profiles_without_materializing() -> None:
    count, param_bytes, growth = profile_on_meta("build_gpt_1p5b")
    assert 1.5e9 < count < 1.6e9
    assert growth < 1 * GIB, (
        f"RSS grew {growth / GIB:.2f} GiB profiling {param_bytes / GIB:.1f} GiB of meta weights"
    )


def test_gpt2_small_on_meta_profiles_without_materializing() -> None:
    count, param_bytes, growth = profile_on_meta("build_gpt2_small")
    assert 120e6 < count < 130e6
    assert growth < GIB // 2, (
        f"RSS grew {growth / GIB:.2f} GiB profiling {param_bytes / GIB:.2f} GiB of meta weights"
    )
    assert torch.empty(0).device.type == "cpu"  # no device context left behind
