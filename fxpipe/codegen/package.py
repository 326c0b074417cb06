"""A traced graph and a plan as an importable Python package (docs/design.md, the output contract).

    files = generate(traced, plan)     # relative file name -> text
    stage0.py ... stage{K-1}.py        # class Stage{k}(nn.Module), see stages.py
    runner.py                          # SCHEDULE, MICROBATCHES, RECOMPUTE, REPLICAS,
                                       # PRECISION, DEVICE_OF, NUM_GPUS, GRAPH_INPUTS,
                                       # flatten_inputs,
                                       # build_output, PipelineRunner bound to them
    distributed.py                     # WIRES, TIED, the torchrun pipeline over them
    __init__.py                        # build_stages, PipelineRunner, SCHEDULE, PLAN, ...;
                                       # distributed.py's names on first use
    train_torchrun.py                  # the torchrun launch script
    plan.json                          # plan.to_json()
    runtime/*.py                       # fxpipe/runtime, copied file for file

Generate data and stage classes; ship behaviour verbatim: everything the plan
decides is written here, everything that runs it is the runtime package, which
the generated files import from their ``runtime`` subpackage. Everything is a
pure function of the graph and the plan: the same input gives byte-identical
files.
"""

from __future__ import annotations

import json
from importlib import resources

import torch.fx

from fxpipe import schedules
from fxpipe.codegen.batch_sizes import BatchDims
from fxpipe.codegen.local_shards import LocalStage
from fxpipe.codegen.signature import build_output_lines, flatten_inputs_lines, tuple_literal
from fxpipe.codegen.stages import (
    LINE_LENGTH,
    PlanError,
    stage_io,
    stage_source,
    wrap_line,
)
from fxpipe.codegen.tensor_parallel import stage_local_pairs, whole_pairs
from fxpipe.codegen.torchrun import (
    distributed_source,
    kind_spec,
    launch_source,
    string_constant,
    tensor_parallel_limit,
    tied_parameters,
    wires,
)
from fxpipe.codegen.wrap import wrap_tuple
from fxpipe.cut import StageIO
from fxpipe.forked import FORK_MIN_NODES, Forked
from fxpipe.frontend import Traced
from fxpipe.plan import Plan

__all__ = ["generate", "pairs_run_whole", "runner_header", "runtime_files", "tied_parameters",
           "wires"]


def pairs_run_whole(gm: torch.fx.GraphModule, plan: Plan) -> list[str]:
    """The tensor-parallel pairs the package of ``plan`` runs whole on every GPU of their
    stage (``codegen/local_shards.py`` cannot follow the ops between them, or a tie keeps a
    weight whole): none at t = 1."""
    if plan.tp == 1:
        return []
    ios = stage_io(gm.graph, plan)
    return whole_pairs(gm, ios, stage_local_pairs(gm, ios, tied_parameters(gm, ios), plan.tp))


def generate(traced: Traced, plan: Plan) -> dict[str, str]:
    """Relative file name -> text of the generated package for ``plan`` over ``traced``."""
    gm = traced.gm
    ios = stage_io(gm.graph, plan)
    fixed = {
        shape.name: tuple(None if free else size for size, free in zip(
            shape.shape, shape.dynamic, strict=True))
        for shape in traced.inputs
        if not all(shape.dynamic)
    }
    dims = BatchDims.of_traced(traced, ios,
                               replicated=any(stage.replicas > 1 for stage in plan.stages))
    # what each stage runs split over plan.tp GPUs: pairs on local shares (none at 1)
    local = stage_local_pairs(gm, ios, tied_parameters(gm, ios), plan.tp)
    sources = _stage_sources(gm, ios, fixed, dims, traced.model, local)
    files = {f"stage{io.index}.py": source for io, source in zip(ios, sources, strict=True)}
    files["runner.py"] = runner_source(traced, plan)
    files["__init__.py"] = init_source(plan)
    files["plan.json"] = plan.to_json()
    # the same stages on torch.distributed.pipelining (see the section below)
    files["distributed.py"] = distributed_source(traced, plan, ios, local)
    files["train_torchrun.py"] = launch_source(plan)
    files.update(runtime_files())
    return dict(sorted(files.items()))


def _stage_sources(gm: torch.fx.GraphModule, ios: list[StageIO],
                   fixed: dict[str, tuple[int | None, ...]], dims: BatchDims,
                   model: torch.nn.Module | None, local: list[LocalStage]
                   ) -> list[str]:
    """Each stage's module, in order. On a big graph (a second or more of writing at 70B
    scale) the later stages are written in a forked child meanwhile: each stage's text
    depends only on the graph and its own inputs and outputs."""
    half = len(ios) // 2
    by_name = {n.name: n for n in gm.graph.nodes}

    def write(chunk: list[StageIO]) -> list[str]:
        return [stage_source(gm, io, fixed, dims, model, by_name, local[io.index])
                for io in chunk]

    big = len(gm.graph.nodes) >= FORK_MIN_NODES and half > 0
    with Forked(lambda: write(ios[half:]), in_child=big) as later:
        return write(ios[:half]) + later.result()


def runtime_files() -> dict[str, str]:
    """``runtime/NAME.py`` -> the text of ``fxpipe/runtime/NAME.py``, for every module
    of the runtime: the package carries it unchanged, so it runs without fxpipe."""
    folder = resources.files("fxpipe.runtime")
    return {
        f"runtime/{entry.name}": entry.read_text(encoding="utf-8")
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".py")
    }


# ---------------------------------------------------------------------------- runner.py


def _one_of_the_layout(plan: Plan) -> list[str]:
    """Where the plan's layout runs more than this one pipeline, that this runner runs one
    pipeline's step on one host, and what runs them all."""
    layout = plan.layout
    if layout is None or layout.dp * layout.tp == 1:
        return []
    tp = f", each stage on {layout.tp} GPUs (tensor parallel)" if layout.tp > 1 else ""
    return [f"This runs one pipeline of the plan's layout of {layout.dp} ({layout.dp_mode}){tp};",
            "train_torchrun.py runs the whole layout under torchrun."]


def runner_source(traced: Traced, plan: Plan) -> str:
    m = plan.microbatches
    doc = [
        f"Pipeline runner for {plan.model or 'the model'}, generated by fxpipe:",
        f"{plan.num_stages} stages, {plan.schedule} schedule, {m} micro-batch{'es' * (m > 1)}.",
        *_one_of_the_layout(plan),
        "",
        "This file holds what the plan decides: the schedule table, the per-stage",
        "settings and the model's input/output mapping. The runtime subpackage runs",
        "them (runtime/runner.py: how a step moves values, streams, replicas and",
        "weight stashing).",
    ]
    return "\n".join([
        '"""' + "\n".join(doc).replace('"""', "'''") + '\n"""',
        "",
        "from collections.abc import Sequence",
        "",
        "from torch import nn",
        "",
        "from . import runtime",
        "from .runtime.placement import DeviceSpec",
        "",
        runner_header(traced, plan),
        "",
        "",
        *_runner_footer(plan),
    ])


def _runner_footer(plan: Plan) -> list[str]:
    """The runner's functions; one that refuses to run a plan no runner runs yet."""
    why = tensor_parallel_limit(plan)
    if why is None:
        return [_RUNNER_FOOTER]
    return ["# UNSUPPORTED: why this plan cannot run here", *string_constant("UNSUPPORTED", why),
            "", "", _RUNNER_FOOTER.replace(
                "    ) -> None:\n", "    ) -> None:\n        raise ValueError(UNSUPPORTED)\n", 1)]


_RUNNER_FOOTER = '''def stage_devices(
    devices: Sequence[DeviceSpec],
) -> list[DeviceSpec | list[DeviceSpec]]:
    """One device per stage: ``devices`` as given when there is one per stage;
    when there is one per GPU (NUM_GPUS), stage k's is ``devices[DEVICE_OF[k]]``,
    or the list of its REPLICAS[k] GPUs from there for a replicated stage."""
    return runtime.stage_devices(devices, DEVICE_OF, REPLICAS, NUM_GPUS)


class PipelineRunner(runtime.PipelineRunner):
    """The runtime's PipelineRunner with this plan's schedule, micro-batches,
    recompute flags, replicas, weight stashing, precision and input/output mapping
    as defaults; ``devices`` as for ``build_stages``: one per stage, or one per GPU."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[DeviceSpec] | None = None,
        *,
        schedule: Sequence[Sequence[tuple[int, str, int]]] = SCHEDULE,
        microbatches: int = MICROBATCHES,
        recompute: Sequence[str] = RECOMPUTE,
        replicas: Sequence[int] = REPLICAS,
        weight_stashing: bool = WEIGHT_STASHING,
        precision: str = PRECISION,
        shared_inputs: Sequence[str] = SHARED_INPUTS,
    ) -> None:
        super().__init__(
            stages,
            None if devices is None else stage_devices(devices),
            schedule=schedule,
            microbatches=microbatches,
            flatten_inputs=flatten_inputs,
            build_output=build_output,
            recompute=recompute,
            replicas=replicas,
            weight_stashing=weight_stashing,
            precision=precision,
            shared_inputs=shared_inputs,
        )
'''


def runner_header(traced: Traced, plan: Plan) -> str:
    """SCHEDULE, MICROBATCHES, RECOMPUTE, REPLICAS, WEIGHT_STASHING, PRECISION, DEVICE_OF,
    NUM_GPUS, GRAPH_INPUTS, flatten_inputs, build_output."""
    k, m, stages = plan.num_stages, plan.microbatches, plan.stages
    device_of = [plan.devices_of(j)[0] for j in range(k)]
    spec = kind_spec(plan)
    interleaved = spec.interleaved or spec.v_placed  # a row per GPU in the picture
    try:
        table = plan.schedule_table()
    except ValueError as err:
        raise PlanError(str(err)) from None
    picture = schedules.render_ascii(table, k, width=LINE_LENGTH - len("#     "),
                                     devices=device_of if interleaved else None)
    graph = traced.gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    lines = [
        f"# The {plan.schedule} schedule, one clock tick per line: the actions"
        ' (stage, "F" | "B", micro-batch)',
        "# that run together. Fm: forward of micro-batch m, Bm: its backward, ..: idle.",
    ]
    if any(kind == "W" for tick in table for _j, kind, _m in tick):
        lines += [
            "# The backward runs in two parts: Im, the input gradient (what the previous",
            "# stage waits for), and Wm, the weight gradient (later, in the bubbles).",
        ]
    if plan.v_placed:
        lines += [
            "# A row per GPU, stages in a V: GPU d runs stage d (a) and stage "
            f"{plan.num_stages - 1} - d (b).",
        ]
    elif interleaved:
        lines += [
            "# A row per GPU; the letter after m is the chunk: GPU d runs stage d (a), "
            f"d + {plan.num_devices} (b), ...",
        ]
    lines += [
        "#",
        *(f"#     {row}".rstrip() for row in picture.splitlines()),
        "SCHEDULE = [",
    ]
    for tick in table:
        lines += wrap_tuple([f'({j}, "{kind}", {mb})' for j, kind, mb in tick], "    ", ",")
    lines += [
        "]",
        f"MICROBATCHES = {m}",
        "# RECOMPUTE[k]: what stage k keeps for its backward: \"none\" all, \"selective\" its",
        "# inputs and matmuls' and attention's outputs, \"full\" its inputs only",
        *(_KEEPS_COMMENT if any(s.keeps or s.skips for s in stages) else ()),
        *wrap_line("RECOMPUTE = " + tuple_literal(json.dumps(s.recompute_mode) for s in stages)),
        "# REPLICAS[k]: how many data-parallel replicas split each micro-batch of stage k;",
        "# WEIGHT_STASHING: PipeDream's update after every micro-batch, with stashed weights",
        *wrap_line(f"REPLICAS = {tuple_literal(str(s.replicas) for s in plan.stages)}"),
        f"WEIGHT_STASHING = {spec.stashes_weights}",
        *_PRECISION_COMMENT[plan.precision.endswith("-mixed")],
        f"PRECISION = {json.dumps(plan.precision)}",
        "# DEVICE_OF[k]: the GPU (0 .. NUM_GPUS - 1) that runs stage k",
        *wrap_line(f"DEVICE_OF = {tuple_literal(str(d) for d in device_of)}"),
        f"NUM_GPUS = {plan.num_devices}",
        *wrap_line(f"GRAPH_INPUTS = {tuple_literal(json.dumps(p.name) for p in placeholders)}"),
        "# SHARED_INPUTS: graph inputs without a batch dimension, whole in every micro-batch",
        *wrap_line("SHARED_INPUTS = " + tuple_literal(json.dumps(n) for n in plan.shared_inputs)),
        "",
        "",
    ]
    lines += [*flatten_inputs_lines(traced), "", "", *build_output_lines(traced)]
    return "\n".join(lines)


_KEEPS_COMMENT = ("# (\"selective:W:N\" keeps only those doing more than W FLOPs per element, and",
                  "# of those doing W, the ones at most N wide; \":W1xN1,...\" never those)")
_PRECISION_COMMENT = {
    True: ["# PRECISION: every stage forward (and the loss) under torch.autocast at this",
           "# dtype, backward outside; float32 parameters (runtime/mixed_precision.py)"],
    False: ["# PRECISION: the dtype the plan assumes; for bf16-true or 16-true cast the model",
            "# and inputs to it before build_stages (runtime/mixed_precision.py)"],
}


# ---------------------------------------------------------------------------- __init__.py


_INIT = '''"""{title}

    stages = build_stages(model)              # the model's own parameters, by name
    runner = PipelineRunner(stages)           # this plan's schedule and micro-batches
{usage}
PLAN is plan.json as a dict. Under torchrun: train_torchrun.py, or pipeline_stage (or
pipeline_stages), build_schedule and train_step in your own script; they are imported,
with torch.distributed.pipelining, on first use.
"""

import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from . import runtime
from .runner import (
    DEVICE_OF,
    MICROBATCHES,
    NUM_GPUS,
    PRECISION,
    RECOMPUTE,
    REPLICAS,
    SCHEDULE,
    WEIGHT_STASHING,
    PipelineRunner,
    stage_devices,
)
from .runtime.placement import DeviceSpec
{stage_imports}

__all__ = [
    "DEVICE_OF",
    "MICROBATCHES",
    "NUM_GPUS",
    "PLAN",
    "PRECISION",
    "RECOMPUTE",
    "REPLICAS",
    "SCHEDULE",
    "WEIGHT_STASHING",
    "PipelineRunner",
    "build_schedule",
    "build_stages",
    "pipeline_stage",
    "pipeline_stages",
    "stage_devices",
    "train_step",
]

# The torchrun entry points, in distributed.py, imported on first use: a run in one
# process never needs torch.distributed.pipelining.
_DISTRIBUTED = ("build_schedule", "pipeline_stage", "pipeline_stages", "train_step")


def __getattr__(name: str) -> Any:
    if name != "distributed" and name not in _DISTRIBUTED:
        raise AttributeError(f"module {{__name__!r}} has no attribute {{name!r}}")
    distributed = importlib.import_module(".distributed", __name__)
    return distributed if name == "distributed" else getattr(distributed, name)


PLAN = json.loads(Path(__file__).with_name("plan.json").read_text(encoding="utf-8"))
{stage_classes}


def build_stages(
    model: nn.Module, devices: Sequence[DeviceSpec] | None = None
) -> list[nn.Module]:
    """One module per stage, bound to ``model``\'s own parameters and buffers;
    with ``devices`` (one per stage, or one per GPU), stage k is moved to its
    device (see ``stage_devices``)."""
    stages = [stage(model) for stage in STAGE_CLASSES]
    return stages if devices is None else runtime.place_stages(stages, stage_devices(devices))
'''

_USAGE = ["    loss = runner.step(inputs, target, loss_fn)"]
_STASHING_USAGE = [
    "    optimizers = [torch.optim.SGD(s.parameters(), lr=0.1) for s in stages]",
    "    loss = runner.step(inputs, target, loss_fn, optimizers=optimizers)",
    "",
    "PipeDream's weight stashing: every stage updates its weights after each",
    "micro-batch's backward with its own optimizer (see runtime/stashing.py).",
]


def init_source(plan: Plan) -> str:
    k = plan.num_stages
    usage = _STASHING_USAGE if kind_spec(plan).stashes_weights else _USAGE
    return _INIT.format(
        title=f"{plan.model or 'The model'} cut into {k} pipeline stages by fxpipe.",
        usage="\n".join(usage) + "\n",
        stage_imports="\n".join(f"from .stage{j} import Stage{j}" for j in range(k)),
        stage_classes="\n".join(
            wrap_line(f"STAGE_CLASSES = {tuple_literal(f'Stage{j}' for j in range(k))}")
        ),
    )


# ---------------------------------------------------------------------------- distributed.py
# The stages one per process on torch.distributed.pipelining: the tables below, bound to
# the runtime's DistributedPipeline (runtime/pipelining.py).
