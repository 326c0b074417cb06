"""Run under torchrun by test_tensor_parallel_torchrun.py: one forward, in training, of a
pp 1 x tp 2 package's stage split over the ranks, each rank first seeded its own way
(as a training script may); writes, to ``OUT/rank{r}.pt``, the mask each dropout drew on
this rank: the one between the pair's linears (on this rank's share of the hidden
width) and the one on the residual stream (whole).

    torchrun --nproc-per-node 2 dropout_masks.py PACKAGE MODEL OUT
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


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
    drawn: list[torch.Tensor] = []
    entered = stage0.tp_own_random

    def own(value: Any, on: Any) -> Any:  # the dropout's input on this rank's share
        drawn.append(value.detach().clone())
        return entered(value, on)

    left = stage0.tp_shared_random

    def shared(value: Any, on: Any) -> Any:  # its output: kept where the mask keeps
        drawn.append(value.detach().clone())
        return left(value, on)

    stage0.tp_own_random, stage0.tp_shared_random = own, shared
    (x,) = source.args
    with runtime.tensor_step(degree, torch.device("cpu")), torch.no_grad():
        (y,) = stage(x=x)
    (before, after) = drawn
    assert bool((before != 0).all())  # tanh of a random input: none zero
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save({"inner": after != 0, "outer": (y - x) != 0, "inner_seen": len(drawn)},
               Path(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
