"""The fxpipe runtime: run pipeline stage modules on a schedule.

It imports only torch and the standard library, and every generated package
carries a byte-identical copy of it as its ``runtime`` subpackage, so a package
runs without fxpipe installed. One idea per module:

    runner.py       PipelineRunner: one process, a clock-tick schedule, CPU or GPUs
    schedule.py     the schedule's dependencies and the check that a table keeps them
    values.py       which stage makes and reads each value; what a step keeps
    microbatch.py   splitting a batch into micro-batches and replica chunks, and merging
    stream.py       CUDA streams and events between stages and devices
    devices.py      device placement; copies of tied parameters on other devices
    replicas.py     data-parallel replicas of a stage in one process
    stashing.py     PipeDream's weight stashing
    recompute.py    the random state a recomputed forward replays
    precision.py    the plan's precision: autocast per stage forward, a GradScaler
    measure.py      the report card: each stage's measured times and memory (measured.json)
    binding.py      how a generated stage binds the model's own parameters, and indexes
                    the modules on the way to them as the model does
    shapes.py       a stage's check of the input dimensions it was traced at
    checkpoint.py   stage state_dicts <-> one model checkpoint
    loading.py      importing a file or a package folder by path
    pipelining.py   DistributedPipeline: the stages under torchrun
    adapter.py      a stage as torch.distributed.pipelining wants it
    ranks.py        which rank runs which stage
    grads.py        tied and replicated gradients across ranks
    table.py        the uneven-replica schedule under torchrun
    zero_bubble.py  zb1p, zbv and dualpipev on torch's zero-bubble schedule classes
    rank_measure.py the report card under torchrun: each rank's stages, gathered
    materialize.py  building only this rank's stage from a checkpoint
    older_torch.py  what torch 2.11's pipelining needs to run the stages
    launch.py       the torchrun entry point (train_torchrun.py)

The torchrun modules import ``torch.distributed.pipelining``; this package's
top level imports only the single-process ones.
"""

from .binding import bind
from .checkpoint import check_stage_states, merge_stage_state_dicts, split_state_dict
from .devices import place_stages, stage_devices
from .loading import import_file, load_package
from .measure import ReportCard, load_card
from .runner import PipelineRunner
from .schedule import check_schedule, dependencies
from .shapes import check_shape

__all__ = [
    "PipelineRunner",
    "ReportCard",
    "bind",
    "check_schedule",
    "check_shape",
    "check_stage_states",
    "dependencies",
    "import_file",
    "load_card",
    "load_package",
    "merge_stage_state_dicts",
    "place_stages",
    "split_state_dict",
    "stage_devices",
]
