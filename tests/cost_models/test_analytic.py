"""The roofline on a tiny traced graph whose records are set by hand."""

import pytest
import torch
import torch.fx
from torch import nn

from fxpipe import meta
from fxpipe.cost_models import DEVICES, analytic

N = 4096  # square matrices, float32
MATRIX_BYTES = N * N * 4


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(N, N)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = torch.matmul(a, b)
        d = torch.relu(c)
        e = d.view(-1)
        return self.proj(e.view(N, N))


def spec(*shape: int, requires_grad: bool = True, dtype: str = "float32") -> meta.ValueInfo:
    nbytes = 4
    for size in shape:
        nbytes *= size
    return meta.ValueInfo((meta.TensorSpec(shape, dtype, nbytes, requires_grad),))


def annotated() -> torch.fx.GraphModule:
    """Tiny traced, with SHAPE, FLOPS and BYTES set by hand."""
    gm = torch.fx.symbolic_trace(Tiny())
    nodes = {node.name: node for node in gm.graph.nodes}
    flops = {
        "matmul": meta.FlopInfo(2 * N**3, 4 * N**3),
        "relu": meta.FlopInfo(N * N, N * N),
        "view": meta.FlopInfo(0, 0),
        "view_1": meta.FlopInfo(0, 0),
        "proj": meta.FlopInfo(2 * N**3 + N * N, 4 * N**3),
    }
    param_bytes = {"proj": (N * N + N) * 4}
    for name, node in nodes.items():
        shape = spec(N * N) if name == "view" else spec(N, N)
        if name == "output":
            continue
        meta.SHAPE.set(node, shape)
        if name in flops:
            meta.FLOPS.set(node, flops[name])
            meta.BYTES.set(
                node,
                meta.MemoryInfo(
                    param_bytes=param_bytes.get(name, 0),
                    buffer_bytes=0,
                    output_bytes=shape.nbytes,
                    saved_bytes=0,
                ),
            )
    return gm


def times(gm: torch.fx.GraphModule) -> dict[str, meta.TimeInfo]:
    return {node.name: meta.TIME.get(node) for node in gm.graph.nodes}


def test_big_matmul_is_compute_bound() -> None:
    h100 = DEVICES["h100"]
    t = times(analytic.annotate_times(annotated(), "h100"))["matmul"]
    flops_s = 2 * N**3 / 67e12
    bytes_s = 3 * MATRIX_BYTES / 3.35e12
    assert flops_s > bytes_s
    assert t.forward_s == pytest.approx(flops_s + h100.launch_overhead)
    assert t.backward_s == pytest.approx(2 * flops_s + h100.launch_overhead)
    assert t.source == "analytic:h100"


def test_elementwise_is_memory_bound() -> None:
    h100 = DEVICES["h100"]
    t = times(analytic.annotate_times(annotated(), h100))["relu"]
    bytes_s = 2 * MATRIX_BYTES / 3.35e12  # read c, write d
    assert bytes_s > N * N / 67e12
    assert t.forward_s == pytest.approx(bytes_s + h100.launch_overhead)
    assert t.backward_s == pytest.approx(2 * bytes_s + h100.launch_overhead)


def test_module_call_counts_its_parameters() -> None:
    a100 = DEVICES["a100-80gb"]
    t = times(analytic.annotate_times(annotated(), "a100"))["proj"]
    flops = 2 * N**3 + N * N
    moved = 2 * MATRIX_BYTES + (N * N + N) * 4
    expected = max(flops / 19.5e12, moved / 2039e9) + a100.launch_overhead
    assert t.forward_s == pytest.approx(expected)


def test_tf32_prices_float32_matmul_at_the_tensor_core_peak() -> None:
    h100 = DEVICES["h100"]
    gm = analytic.annotate_times(annotated(), h100, allow_tf32=True)
    t = times(gm)["matmul"]
    assert t.forward_s == pytest.approx(2 * N**3 / 494.5e12 + h100.launch_overhead)


def test_views_placeholders_and_output_are_free() -> None:
    t = times(analytic.annotate_times(annotated(), "h100"))
    for name in ("a", "b", "view", "view_1", "output"):
        assert (t[name].forward_s, t[name].backward_s) == (0.0, 0.0), name


def test_no_backward_when_the_output_needs_no_grad() -> None:
    h100 = DEVICES["h100"]
    t = analytic.node_time(
        flops=meta.FlopInfo(1000, 2000),
        nbytes=4000,
        dtype="float32",
        requires_grad=False,
        device=h100,
    )
    assert t.backward_s == 0.0
    assert t.forward_s == pytest.approx(max(1000 / 67e12, 4000 / 3.35e12) + h100.launch_overhead)


def test_dtype_picks_the_peak() -> None:
    h100 = DEVICES["h100"]
    bf16 = analytic.node_time(
        flops=meta.FlopInfo(2 * N**3, 4 * N**3),
        nbytes=0,
        dtype="bfloat16",
        requires_grad=True,
        device=h100,
    )
    assert bf16.forward_s == pytest.approx(2 * N**3 / 989.5e12 + h100.launch_overhead)


def test_nothing_to_do_costs_nothing() -> None:
    assert analytic.roofline_time(0, 0, device=DEVICES["h100"], dtype="float32") == 0.0


def test_missing_records_name_the_pass() -> None:
    gm = torch.fx.symbolic_trace(Tiny())
    with pytest.raises(meta.MissingMeta, match="annotate_flops"):
        analytic.annotate_times(gm, "h100")
