"""The measured model on the CPU (and on CUDA where there is one)."""

from collections.abc import Iterator

import pytest
import torch
import torch.fx
from torch import nn

from fxpipe import meta
from fxpipe.cost_models import measured


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(inplace=True), nn.Linear(64, 8))


def computing(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op in ("call_module", "call_function", "call_method") and n.target != "_guards_fn"
    ]


def check_positive(gm: torch.fx.GraphModule, source: str) -> None:
    nodes = computing(gm)
    assert nodes
    for node in nodes:
        t = meta.TIME.get(node)
        assert t.source == source
        assert t.forward_s > 0, node.format_node()
        assert t.backward_s > 0, node.format_node()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            assert meta.TIME.get(node).forward_s == 0.0


def test_symbolic_trace_mlp_gets_positive_times() -> None:
    gm = torch.fx.symbolic_trace(mlp())
    x = torch.randn(4, 32)
    measured.annotate_times(gm, x, warmup=1, repeats=3)
    check_positive(gm, "measured:cpu")


def test_export_mlp_gets_positive_times() -> None:
    x = torch.randn(4, 32)
    gm = torch.export.export(mlp(), (x,), strict=False).module()
    assert isinstance(gm, torch.fx.GraphModule)
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    measured.annotate_times(gm, x, warmup=1, repeats=3)
    check_positive(gm, "measured:cpu")


def test_does_not_change_the_model_or_its_inputs() -> None:
    model = mlp()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(4, 32)
    before = [p.detach().clone() for p in model.parameters()]
    x_before = x.clone()
    measured.annotate_times(gm, x, warmup=0, repeats=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(x, x_before)


def test_no_grad_input_and_no_parameters_means_no_backward() -> None:
    gm = torch.fx.symbolic_trace(nn.ReLU())
    measured.annotate_times(gm, torch.randn(16), warmup=0, repeats=1)
    (node,) = computing(gm)
    assert meta.TIME.get(node).backward_s == 0.0


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a loaded machine OpenMP barriers stall for scheduler ticks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_larger_linear_takes_longer(one_thread: None) -> None:
    class TwoLinears(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.Linear(16, 16)
            self.big = nn.Linear(16, 1024)
            self.big2 = nn.Linear(1024, 1024)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.small(x), self.big2(self.big(x))

    gm = torch.fx.symbolic_trace(TwoLinears())
    measured.annotate_times(gm, torch.randn(256, 16), warmup=2, repeats=5)
    # small: 256·16·16 MACs; big2: 256·1024·1024 MACs, 4096× the work.
    t = {n.target: meta.TIME.get(n) for n in computing(gm)}
    assert t["big2"].forward_s > t["small"].forward_s
    assert t["big2"].backward_s > t["small"].backward_s


def test_rejects_inputs_on_another_device() -> None:
    gm = torch.fx.symbolic_trace(mlp())
    with pytest.raises(ValueError, match="repeats"):
        measured.annotate_times(gm, torch.randn(4, 32), repeats=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            measured.annotate_times(gm, torch.randn(4, 32), device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_measures_times_and_memory() -> None:
    model = mlp().cuda()
    x = torch.randn(64, 32, device="cuda")
    for gm in (
        torch.fx.symbolic_trace(model),
        torch.export.export(model, (x,), strict=False).module(),
    ):
        measured.annotate_times(gm, x, device="cuda", warmup=2, repeats=5)
        check_positive(gm, "measured:cuda")
        for node in computing(gm):
            memory = meta.MEASURED_MEMORY.get(node)
            assert memory.peak_bytes >= memory.kept_bytes >= 0
        linear = computing(gm)[0]
        # The first Linear keeps at least its 64×64 float32 output.
        assert meta.MEASURED_MEMORY.get(linear).kept_bytes >= 64 * 64 * 4
