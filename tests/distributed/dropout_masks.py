"""Run under torchrun by test_tensor_parallel_torchrun.py: one forward, in training, of a
pp 1 x tp 2 package's stage split over the ranks, each rank first seeded its own way
(as a training script may); writes, to ``OUT/rank{r}.pt``, the mask each dropout of
dropout_mlp.py drew on this rank, as this rank holds its output: ``pre`` whole, ``inner``
its share of the hidden width, ``outer`` its share of the tokens.

    torchrun --nproc-per-node 2 dropout_masks.py PACKAGE MODEL OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

try:
    from tests.distributed.tp_stage import one_stage
except ModuleNotFoundError:  # run as a script: its folder is on the path
    from tp_stage import one_stage  # type: ignore[no-redef]


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def main(package: str, model_file: str, out: str) -> None:
    one = one_stage(package, model_file, "dropout_masks_pkg")
    source = one.source
    torch.manual_seed(100 + one.rank)  # each rank its own state: the split makes them agree
    one.split()
    masks: dict[str, torch.Tensor] = {}

    def record(name: str) -> Any:
        def hook(_: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            assert bool((_local(inputs[0]) != 0).all())  # so a zero out is a drop
            masks[name] = _local(output) != 0
        return hook

    for name in ("pre", "inner", "outer"):
        getattr(source.model, name).register_forward_hook(record(name))
    (x,) = source.args
    with one.step(), torch.no_grad():
        one.stage(x=x)
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save(masks, Path(out, f"rank{one.rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
