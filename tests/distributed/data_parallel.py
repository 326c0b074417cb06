"""Pipelines composed with data parallelism, as a user would compose them:
``torchrun --nproc-per-node 4 data_parallel.py PACKAGE MODEL BATCH OUT`` runs two
pipelines of the package's two stages, ranks 0-1 and ranks 2-3, each on its own process
group (``group=``) and half of the global mini-batch in BATCH; then every gradient is
averaged over the data-parallel dimension (ranks 0 and 2, ranks 1 and 3), as DDP would
average it, and each rank saves its gradients to OUT/rank{r}.pt::

    pipeline 0 | rank 0 (stage 0) ──► rank 1 (stage 1)     rows 0 .. N/2 - 1
    pipeline 1 | rank 2 (stage 0) ──► rank 3 (stage 1)     rows N/2 .. N - 1
                 └─ all-reduce ─┘     └─ all-reduce ─┘     every gradient, averaged
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.runtime import import_file, load_package

PP = 2  # stages per pipeline


def main(package_dir: str, model_file: str, batch_file: str, out: str) -> None:
    distributed = load_package(package_dir).distributed
    rank, world_size, device = distributed.init_distributed()
    dp = world_size // PP
    # every rank makes every group, in the same order
    pipelines = [dist.new_group([p * PP + s for s in range(PP)]) for p in range(dp)]
    replicas = [dist.new_group([p * PP + s for p in range(dp)]) for s in range(PP)]
    p, s = divmod(rank, PP)
    user = import_file(model_file, "data_parallel_model")
    stages = distributed.pipeline_stages(user.build_model(), s, PP, device,
                                         *user.example_inputs(), group=pipelines[p])
    schedule = distributed.build_schedule(stages, user.loss_fn)
    batch = torch.load(batch_file, weights_only=True)
    rows = batch["target"].size(0) // dp
    (ids,), target = batch["args"], batch["target"]
    distributed.train_step(schedule, stages, ids[p * rows:(p + 1) * rows],
                           target=target[p * rows:(p + 1) * rows])
    grads, averaged = {}, set()
    for stage in stages:
        module: nn.Module = stage.submod.stage
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) not in averaged:  # a parameter under two names: once
                averaged.add(id(param))
                dist.all_reduce(param.grad, group=replicas[s])
                param.grad /= dp
            grads[name] = param.grad.detach().clone()
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save({"grads": grads}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
