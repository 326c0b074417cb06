"""runner.measure(serial=True): stages that share a GPU run on one stream while measured,
so each one is timed alone; the results are the same, and the streams come back after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fxpipe.runtime.measure import one_stream_per_device
from fxpipe.schedules import one_f_one_b
from runtime.test_runtime import data, loss_fn, make, reference_grads, runner


def test_one_stream_per_device_keeps_the_first_stream_of_each_device() -> None:
    a, b, c, d = (object() for _ in range(4))
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert one_stream_per_device([a, b, c, d], [gpu0, gpu0, gpu1, gpu1]) == [a, a, c, c]
    assert one_stream_per_device([a, b, c], [gpu0, gpu1, gpu0]) == [a, b, a]
    cpu = torch.device("cpu")  # a CPU stage has no stream and runs in order
    assert one_stream_per_device([None, b, None], [cpu, gpu0, cpu]) == [None, b, None]
    assert one_stream_per_device([None, None], None) == [None, None]


def test_serial_measure_is_recorded_and_gives_the_same_gradients(tmp_path: Path) -> None:
    model, stages = make(torch.float64)
    x, y = data(torch.float64)
    ref_loss, ref_grads = reference_grads(model, x, y, 2)
    pipe = runner(stages, one_f_one_b, 4)
    with pipe.measure(warmup=0, serial=True) as card:
        loss = pipe.step((x,), y, loss_fn)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-12, atol=1e-12)
    assert json.loads(card.save(tmp_path / "measured.json").read_text())["serial"] is True
    with pipe.measure(warmup=0) as card:
        pipe.step((x,), y, loss_fn)
    assert card.to_dict()["serial"] is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serial_measure_runs_stages_sharing_a_gpu_on_one_stream() -> None:
    x, y = data(torch.float64)
    model, stages = make(torch.float64)
    ref_loss, ref_grads = reference_grads(model, x, y, 2)
    model, stages = make(torch.float64)
    model.cuda()
    pipe = runner(stages, one_f_one_b, 4, devices=[torch.device("cuda", 0)] * 3)
    streams = list(pipe.streams.compute)
    assert len({s.cuda_stream for s in streams}) == 3
    with pipe.measure(warmup=0, serial=True) as card:
        assert len({s.cuda_stream for s in pipe.streams.compute}) == 1
        loss = pipe.step((x.cuda(),), y.cuda(), loss_fn)
    torch.cuda.synchronize()
    assert pipe.streams.compute == streams  # side by side again after measuring
    assert card.serial and all(s.forward_s > 0 for s in card.stages())
    torch.testing.assert_close(loss.cpu(), ref_loss, rtol=1e-10, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref_grads[name], rtol=1e-10, atol=1e-12)
