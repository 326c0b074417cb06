"""TinyMLP's 2 stages on torch.distributed.pipelining, generated
by fxpipe: what the plan decides (the values each stage receives, the tied
parameters), bound to the runtime's DistributedPipeline (runtime/pipelining.py).
"""

from .runner import (
    DEVICE_OF,
    MICROBATCHES,
    PRECISION,
    RECOMPUTE,
    REPLICAS,
    SCHEDULE,
    SHARED_INPUTS,
    build_output,
    flatten_inputs,
)
from .runtime.launch import init_distributed, main, peak_rss_bytes
from .runtime.materialize import parameters_on_meta
from .runtime.pipelining import DistributedPipeline
from .stage0 import Stage0
from .stage1 import Stage1

__all__ = [
    "PIPELINE",
    "TIED",
    "WIRES",
    "build_schedule",
    "init_distributed",
    "main",
    "parameters_on_meta",
    "peak_rss_bytes",
    "pipeline_stage",
    "pipeline_stages",
    "reduce_grads",
    "stage_module",
    "train_step",
]

STAGE_CLASSES = (Stage0, Stage1)
SCHEDULE_KIND = "1f1b"
# VIRTUAL_STAGES: stages per rank; with more than one, stage k on rank DEVICE_OF[k]
VIRTUAL_STAGES = 1
# UNSUPPORTED: why this plan cannot run here (None: it can)
UNSUPPORTED = None
# WIRES[k]: the values stage k receives, in this order; a value passes through
# every stage between the one that makes it and the last one that reads it.
WIRES = (
    # into stage 0
    ("x", "scale"),
    # into stage 1
    ("scale", "relu", "relu_1"),
)
# TIED: parameters bound by several stages, stage -> name; their gradients are
# summed over exactly the ranks of those stages after backward.
TIED = ()

PIPELINE = DistributedPipeline(
    stage_classes=STAGE_CLASSES,
    wires=WIRES,
    tied=TIED,
    schedule=SCHEDULE_KIND,
    microbatches=MICROBATCHES,
    flatten_inputs=flatten_inputs,
    build_output=build_output,
    replicas=REPLICAS,
    table=SCHEDULE,
    unsupported=UNSUPPORTED,
    virtual_stages=VIRTUAL_STAGES,
    precision=PRECISION,
    device_of=DEVICE_OF,
    shared_inputs=SHARED_INPUTS,
    recompute=RECOMPUTE,
)
stage_module = PIPELINE.stage_module
pipeline_stage = PIPELINE.pipeline_stage
pipeline_stages = PIPELINE.pipeline_stages
build_schedule = PIPELINE.build_schedule
train_step = PIPELINE.train_step
reduce_grads = PIPELINE.reduce_grads
