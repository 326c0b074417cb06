"""Run under torchrun by test_tensor_parallel_torchrun.py: one forward of a pp 1 x tp 2
package's stage split over the ranks, under torch's ``CommDebugMode``; writes the
collectives it ran, the shape of the first attention's local query, and how far the
logits are from the unsplit model's, to ``OUT/rank{r}.json``.

    torchrun --nproc-per-node 2 comm_counts.py PACKAGE MODEL OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

try:
    from tests.distributed.tp_stage import one_stage
except ModuleNotFoundError:  # run as a script: its folder is on the path
    from tp_stage import one_stage  # type: ignore[no-redef]


def main(package: str, model_file: str, out: str) -> None:
    one = one_stage(package, model_file, "comm_counts_pkg")
    source, stage = one.source, one.stage
    with torch.no_grad():
        want = source.model(*source.args, **source.kwargs)
    one.split()
    shapes: list[list[int]] = []
    share = one.runtime.tp_share

    def recorded(value: torch.Tensor) -> torch.Tensor:  # the first column's local share
        local = share(value)
        shapes.append(list(local.shape))
        return local

    one.module.tp_share = recorded
    counter = CommDebugMode()
    with one.step(), counter, torch.no_grad():
        given = {**dict(zip(stage.INPUTS, source.args, strict=False)), **source.kwargs}
        (logits,) = stage(**{name: given[name] for name in stage.INPUTS})
    got = logits.full_tensor() if isinstance(logits, DTensor) else logits
    want = getattr(want, "logits", want)
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in counter.get_comm_counts().items()}
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{one.rank}.json").write_text(json.dumps({
        "counts": counts, "first_share": shapes[0] if shapes else None,
        "error": float((got - want).abs().max() / want.abs().max())}))
    # no rank closes its connections while the other may still read from them in the
    # last all-gather (rank 0 once died "terminate called without an active exception"
    # at exit under a loaded CI; not reproduced since)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
