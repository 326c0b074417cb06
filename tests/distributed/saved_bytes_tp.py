"""Run under torchrun by test_tensor_parallel_torchrun.py: one forward of a pp 1 x tp 2
package's stage split over the ranks, counting the bytes autograd keeps for the backward
on this rank (each storage once, parameters not), to ``OUT/rank{r}.json``: what the
plan's activations per micro-batch predict.

    torchrun --nproc-per-node 2 saved_bytes_tp.py PACKAGE MODEL OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

try:
    from tests.distributed.tp_stage import one_stage
except ModuleNotFoundError:  # run as a script: its folder is on the path
    from tp_stage import one_stage  # type: ignore[no-redef]


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()


def main(package: str, model_file: str, out: str) -> None:
    one = one_stage(package, model_file, "saved_bytes_pkg")
    source, stage = one.source, one.stage
    one.split()
    params = {_storage(p).data_ptr() for p in stage.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = _storage(tensor)
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    given = {**dict(zip(stage.INPUTS, source.args, strict=False)), **source.kwargs}
    with (one.step(),
          torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)):
        stage(**{name: given[name] for name in stage.INPUTS})
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{one.rank}.json").write_text(json.dumps({"saved": sum(kept.values())}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
