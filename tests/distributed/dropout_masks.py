"""Run under torchrun by test_tensor_parallel_torchrun.py: one forward, in training, of a
pp 1 x tp 2 package's stage split over the ranks, each rank first seeded its own way
(as a training script may); writes, to ``OUT/rank{r}.pt``, the mask each dropout of
dropout_mlp.py drew on this rank, as this rank holds its output: ``pre`` whole, ``inner``
its share of the hidden width, ``outer`` its share of the tokens.

    torchrun --nproc-per-node 2 dropout_masks.py PACKAGE MODEL OUT
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def main(package: str, model_file: str, out: str) -> None:
    from fxpipe.codegen import load_package
    from fxpipe.frontend import load_model_file

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    load_package(Path(package), "dropout_masks_pkg")
    stage0 = importlib.import_module("dropout_masks_pkg.stage0")
    runtime = importlib.import_module("dropout_masks_pkg.runtime.tensor_parallel")
    degree, splits = importlib.import_module("dropout_masks_pkg.distributed").TENSOR_PARALLEL
    source = load_model_file(model_file)
    stage = stage0.Stage0(source.model)
    torch.manual_seed(100 + rank)  # each rank its own state: the split makes them agree
    mesh = init_device_mesh("cpu", (degree,), mesh_dim_names=("tp",))
    runtime.split_stage(stage, splits[0], mesh, last=True)
    masks: dict[str, torch.Tensor] = {}

    def record(name: str) -> Any:
        def hook(_: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            assert bool((_local(inputs[0]) != 0).all())  # so a zero out is a drop
            masks[name] = _local(output) != 0
        return hook

    for name in ("pre", "inner", "outer"):
        getattr(source.model, name).register_forward_hook(record(name))
    (x,) = source.args
    with runtime.tensor_step(degree, torch.device("cpu")), torch.no_grad():
        stage(x=x)
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save(masks, Path(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
