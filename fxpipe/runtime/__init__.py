"""The fxpipe runtime: run pipeline stage modules on a schedule.

It imports only torch and the standard library, and every generated package
carries a byte-identical copy of it as its ``runtime`` subpackage, so a package
runs without fxpipe installed. One idea per module:

    runner.py       PipelineRunner: one process, a clock-tick schedule, CPU or GPUs
    calls.py        a runner call's arguments as the graph inputs, checked first
    schedule.py     the schedule's dependencies and the check that a table keeps them
    values.py       which stage makes and reads each value; what a step keeps
    microbatch.py   splitting a batch into micro-batches and replica chunks, and merging
    stream.py       CUDA streams and events between stages and devices
    placement.py    device placement; copies of tied parameters on other devices
    replicas.py     data-parallel replicas of a stage in one process
    stashing.py     PipeDream's weight stashing
    recompute.py    the random state a recomputed forward replays
    recompute_modes.py  the recompute modes in words; a selective stage's keep rule
    mixed_precision.py  the plan's precision: autocast per stage forward, a GradScaler
    measure.py      measuring a step: each stage's times and memory (measured.json)
    binding.py      how a generated stage binds the model's own parameters, and indexes
                    the modules on the way to them as the model does
    input_dims.py   a stage's check of the input dimensions it was traced at
    checkpoint.py   stage state_dicts <-> one model checkpoint
    loading.py      importing a file or a package folder by path
    pipelining.py   DistributedPipeline: the stages under torchrun, their schedule and step
    rank_stages.py  RankStages: the stages one rank builds, on its plan's process groups
    adapter.py      a stage as torch.distributed.pipelining wants it
    ranks.py        which rank runs which stage
    grads.py        tied and replicated gradients across ranks
    tensor_parallel.py  each stage split over a host's GPUs as DTensors (tp)
    tp_random.py        random draws on a split stage: own per rank on a share, else alike
    table.py        the uneven-replica schedule under torchrun
    torch_schedules.py  which torch class runs each schedule kind, placing the stages how
    torch_zero_bubble.py  zb1p, zbv and dualpipev on torch's zero-bubble schedule classes
    rank_measure.py measuring under torchrun: each rank's stages, gathered
    materialize.py  building only this rank's stage from a checkpoint
    older_torch.py  what torch 2.11's pipelining needs to run the stages
    own_loss.py     a model that computes its own loss, under torch's schedules
    launch.py       the torchrun entry point (train_torchrun.py)

The torchrun modules import ``torch.distributed.pipelining``. This package's top level
names the single-process ones' public objects and imports each module on first use, so
that reading schedule.py (pure Python: fxpipe's command line checks schedules with it)
does not wait for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers see them (``X as X``: re-exported)
    from .binding import bind as bind
    from .checkpoint import check_stage_states as check_stage_states
    from .checkpoint import merge_stage_state_dicts as merge_stage_state_dicts
    from .checkpoint import split_state_dict as split_state_dict
    from .input_dims import check_shape as check_shape
    from .loading import import_file as import_file
    from .loading import load_package as load_package
    from .measure import Measurement as Measurement
    from .measured_file import load_measured as load_measured
    from .placement import place_stages as place_stages
    from .placement import stage_devices as stage_devices
    from .runner import PipelineRunner as PipelineRunner
    from .schedule import check_schedule as check_schedule
    from .schedule import dependencies as dependencies
    from .tensor_parallel import tp_joined as tp_joined
    from .tensor_parallel import tp_replicated as tp_replicated
    from .tensor_parallel import tp_share as tp_share
    from .tensor_parallel import tp_tokens as tp_tokens
    from .tensor_parallel import tp_whole as tp_whole
    from .tp_random import tp_own_random as tp_own_random
    from .tp_random import tp_shared_random as tp_shared_random

# Each public name and the module that defines it.
_HOMES = {
    "Measurement": "measure",
    "PipelineRunner": "runner",
    "bind": "binding",
    "check_schedule": "schedule",
    "check_shape": "input_dims",
    "check_stage_states": "checkpoint",
    "dependencies": "schedule",
    "import_file": "loading",
    "load_measured": "measured_file",
    "load_package": "loading",
    "merge_stage_state_dicts": "checkpoint",
    "place_stages": "placement",
    "split_state_dict": "checkpoint",
    "stage_devices": "placement",
    "tp_joined": "tensor_parallel",
    "tp_own_random": "tp_random",
    "tp_replicated": "tensor_parallel",
    "tp_share": "tensor_parallel",
    "tp_shared_random": "tp_random",
    "tp_tokens": "tensor_parallel",
    "tp_whole": "tensor_parallel",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # later reads find it without this function
    return value
