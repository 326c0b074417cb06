"""Run under torchrun by test_tensor_parallel_torchrun.py: one forward of a pp 1 x tp 2
package's stage split over the ranks, counting the bytes autograd keeps for the backward
on this rank (each storage once, parameters not), to ``OUT/rank{r}.json``: what the
plan's activations per micro-batch predict.

    torchrun --nproc-per-node 2 saved_bytes_tp.py PACKAGE MODEL OUT
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


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()


def main(package: str, model_file: str, out: str) -> None:
    from fxpipe.codegen import load_package
    from fxpipe.frontend import load_model_file

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    load_package(Path(package), "saved_bytes_pkg")
    stage0 = importlib.import_module("saved_bytes_pkg.stage0")
    runtime = importlib.import_module("saved_bytes_pkg.runtime.tensor_parallel")
    degree, splits = importlib.import_module("saved_bytes_pkg.distributed").TENSOR_PARALLEL
    source = load_model_file(model_file)
    stage = stage0.Stage0(source.model)
    mesh = init_device_mesh("cpu", (degree,), mesh_dim_names=("tp",))
    runtime.split_stage(stage, splits[0], mesh, last=True)
    params = {_storage(p).data_ptr() for p in stage.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = _storage(tensor)
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    given = {**dict(zip(stage.INPUTS, source.args, strict=False)), **source.kwargs}
    with (runtime.tensor_step(degree, torch.device("cpu")),
          torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)):
        stage(**{name: given[name] for name in stage.INPUTS})
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"saved": sum(kept.values())}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
