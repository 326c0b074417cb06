"""Run under torchrun by test_tensor_parallel_torchrun.py: one forward of a pp 1 x tp 2
package's stage split over the ranks, under torch's ``CommDebugMode``; writes the
collectives it ran, the shape of the first attention's local query, and how far the
logits are from the unsplit model's, to ``OUT/rank{r}.json``.

    torchrun --nproc-per-node 2 comm_counts.py PACKAGE MODEL OUT
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode


def main(package: str, model_file: str, out: str) -> None:
    from fxpipe.codegen import load_package
    from fxpipe.frontend import load_model_file

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    load_package(Path(package), "comm_counts_pkg")
    stage0 = importlib.import_module("comm_counts_pkg.stage0")
    runtime = importlib.import_module("comm_counts_pkg.runtime.tensor_parallel")
    degree, splits = importlib.import_module("comm_counts_pkg.distributed").TENSOR_PARALLEL
    source = load_model_file(model_file)
    with torch.no_grad():
        want = source.model(*source.args, **source.kwargs)
    stage = stage0.Stage0(source.model)
    mesh = init_device_mesh("cpu", (degree,), mesh_dim_names=("tp",))
    runtime.split_stage(stage, splits[0], mesh, last=True)
    shapes: list[list[int]] = []
    share = runtime.tp_share

    def recorded(value: torch.Tensor) -> torch.Tensor:  # the first column's local share
        local = share(value)
        shapes.append(list(local.shape))
        return local

    stage0.tp_share = recorded
    counter = CommDebugMode()
    with runtime.tensor_step(degree, torch.device("cpu")), counter, torch.no_grad():
        given = {**dict(zip(stage.INPUTS, source.args, strict=False)), **source.kwargs}
        (logits,) = stage(**{name: given[name] for name in stage.INPUTS})
    got = logits.full_tensor() if isinstance(logits, DTensor) else logits
    want = getattr(want, "logits", want)
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in counter.get_comm_counts().items()}
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "counts": counts, "first_share": shapes[0] if shapes else None,
        "error": float((got - want).abs().max() / want.abs().max())}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
