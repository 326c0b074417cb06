"""What ``fxpipe split`` is asked to plan: ``SplitOptions``, the options a plan was made
with (``options_of``), to plan it again, and how the asked device runs the graph at the
asked precision (``execution``), as the passes cost it."""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.cost_models import Device
from fxpipe.kernels import Execution
from fxpipe.partition import Recompute
from fxpipe.partition.solve import WORK_LIMIT
from fxpipe.plan import Plan
from fxpipe.precision import Precision, parse_precision
from fxpipe.schedules import ScheduleKind

__all__ = ["ClusterOptions", "SplitOptions", "execution", "options_of"]


@dataclass(frozen=True)
class ClusterOptions:
    """The cluster search (``fxpipe.cluster``): ``SplitOptions.gpus`` GPUs, ``gpus_per_node``
    to a host (None: 8, or all of them when fewer), run as ``pp`` GPUs per pipeline times
    gpus / pp pipelines (None: the search chooses), the copies of each stage kept equal by
    ``dp_mode`` ("fsdp" or "ddp"; None: the search chooses), ``global_batch`` samples per
    step (None: ``SplitOptions.microbatches`` micro-batches of the example's samples),
    each stage's ops split over ``tp`` GPUs of a host (1: none, as before tensor
    parallelism; None: the search chooses), every op at ``compute_efficiency`` of the cost
    model's speed (None: ``partition.layout.COMPUTE_EFFICIENCY``, the roofline's; 1.0
    under ``--calibrate``, whose costs are measured)."""

    gpus_per_node: int | None = None
    pp: int | None = None
    dp_mode: str | None = None
    global_batch: int | None = None
    tp: int | None = 1
    compute_efficiency: float | None = None
    microbatches: int | None = None  # --microbatches given beside global_batch: must agree


@dataclass(frozen=True)
class SplitOptions:
    gpus: int
    device: Device
    memory_limit: float  # bytes per GPU
    microbatches: int
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    optimizer: str = "adam"
    recompute: Recompute = Recompute.AUTO  # per stage: none, selective, all, or the solver's
    time_limit_s: float = 120.0  # wall-clock safety net (the work limit normally stops first)
    work_limit: float = WORK_LIMIT  # CP-SAT deterministic time: the same plan at any load
    virtual_stages: int = 1  # interleaved schedule: stage modules per GPU
    replicate: bool = False  # let the solver give a stage several GPUs ("2-1-1")
    precision: Precision | None = None  # None: the model's parameter dtype; as analyze() used
    # the cluster search (``fxpipe.cluster``), which every request makes but --replicate's:
    # None is one pipeline on all the GPUs, its stages replicated as the solver chooses
    cluster: ClusterOptions | None = None
    # set by the cluster search for the layout it plans (``fxpipe.cluster``): the d
    # pipelines' data-parallel mode, whether stages send across hosts, and the GPUs of a
    # host that split each stage's ops (tensor parallelism)
    data_parallel: tuple[int, str] = (1, "ddp")
    across_hosts: bool = False
    tensor_parallel: int = 1
    compute_efficiency: float = 1.0  # the share of the cost model's speed a GPU reaches


def options_of(plan: Plan) -> SplitOptions:
    """The options that re-make ``plan`` (recompute chosen per stage again; the memory
    limit and device as the plan records them), to re-plan it with new costs."""
    from fxpipe.cost_models import get_device

    layout = plan.layout
    return SplitOptions(
        gpus=plan.num_devices,
        device=get_device(plan.device),
        memory_limit=plan.memory_limit,
        microbatches=plan.microbatches,
        schedule=ScheduleKind(plan.schedule),
        optimizer=plan.optimizer,
        virtual_stages=plan.virtual_stages,
        replicate=any(stage.replicas > 1 for stage in plan.stages),
        precision=parse_precision(plan.precision),
        data_parallel=(1, "ddp") if layout is None else (layout.dp, layout.dp_mode),
        across_hosts=layout is not None and layout.pipeline_link == "inter",
        tensor_parallel=plan.tp,
        compute_efficiency=plan.compute_efficiency,
    )


def execution(device: Device, precision: Precision | None) -> Execution:
    """How ``device`` runs the graph (its fused attention kernels) at ``precision``."""
    return Execution(
        kernels="cpu" if device.kernels == "cpu" else "cuda",
        flash_attention=device.flash_attention,
        precision=precision,
    )
