"""The torchrun half of a generated package: distributed.py (the wires between stages,
the tied parameters, the plan's data-parallel layout, what cannot run under torchrun) and
train_torchrun.py; package.py writes the rest."""

from __future__ import annotations

import json
import textwrap

import torch.fx

from fxpipe import schedules
from fxpipe.codegen.local_shards import LocalStage
from fxpipe.codegen.signature import tuple_literal
from fxpipe.codegen.stages import PlanError, wrap_line
from fxpipe.codegen.tensor_parallel import tensor_parallel_lines
from fxpipe.cut import StageIO
from fxpipe.frontend import Traced
from fxpipe.plan import Plan
from fxpipe.runtime.torch_zero_bubble import ZERO_BUBBLE, requirement

__all__ = ["distributed_source", "kind_spec", "launch_source", "string_constant",
           "tensor_parallel_limit", "tied_parameters", "wires"]


def kind_spec(plan: Plan) -> schedules.KindSpec:
    """How the plan's schedule kind behaves (``fxpipe.schedules.KINDS``)."""
    try:
        return schedules.kind_of(plan.schedule).spec
    except ValueError as err:
        raise PlanError(str(err)) from None


def string_constant(name: str, text: str | None) -> list[str]:
    """``NAME = None``, or ``NAME = (`` the text in string pieces under the line limit ``)``."""
    if text is None:
        return [f"{name} = None"]
    words = text.split(" ")
    pieces, line = [], ""
    for word in words:
        if line and len(line) + len(word) > 70:
            pieces.append(line)
            line = ""
        line += word + " "
    pieces.append(line.rstrip(" "))
    return [f"{name} = (", *(f"    {json.dumps(p)}" for p in pieces), ")"]


def tensor_parallel_limit(plan: Plan) -> str | None:
    """Why the one-process runner does not run ``plan``, or None: its layout splits each
    stage over tp GPUs of a host (tensor parallelism), which runs under torchrun only."""
    layout = plan.layout
    if layout is None or layout.tp == 1:
        return None
    return (f"this plan splits each stage over {layout.tp} GPUs (tensor parallelism, "
            f"--tp {layout.tp}), which runs under torchrun only (train_torchrun.py, "
            f"{_processes(plan) * layout.tp} processes); split again with --tp 1 to run it "
            f"in one process")


def _distributed_limit(plan: Plan) -> str | None:
    """Why ``distributed.py`` cannot run ``plan``, or None: its schedule kind has no
    torch.distributed.pipelining class to run on, or splits the backward of replicated
    stages. (DDP copies of stages split over GPUs, whose DTensor parameters DDP does not
    take, are never planned: ``request`` and ``partition.layout.candidates``.)"""
    spec = kind_spec(plan)
    if spec.splits_backward and any(stage.replicas > 1 for stage in plan.stages):
        return (f"this plan's {plan.schedule} stages are replicated ({plan.configuration}), "
                f"which a schedule that splits the backward does not run; split again "
                f"without --replicate")
    if spec.torch_class is not None:
        return None
    why = " (weight stashing)" if spec.stashes_weights else ""
    names = [kind.value for kind, other in schedules.KINDS.items() if other.torch_class]
    return (f"this plan's {plan.schedule} stages{why} run in runner.PipelineRunner (one "
            f"process) only; for torchrun, split with --schedule {', '.join(names[:-1])} or "
            f"{names[-1]}")


def wires(graph: torch.fx.Graph, ios: list[StageIO]) -> list[tuple[str, ...]]:
    """``wires[k]``: the values stage k receives from stage k - 1 (``wires[0]``: the
    graph inputs any stage reads), in graph order. torch's stages talk to their
    neighbours only, so a value crosses every boundary between its producer and its
    last reader (the model's output is read after the last stage)."""
    k_last = len(ios) - 1
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    producer = {n.name: -1 for n in graph.nodes if n.op == "placeholder"}
    last_reader: dict[str, int] = {}
    for io in ios:
        producer.update(dict.fromkeys(io.outputs, io.index))
        for name in io.inputs:
            last_reader[name] = max(last_reader.get(name, -1), io.index)
    for node in graph.output_node().all_input_nodes:
        if node.name in producer:
            last_reader[node.name] = k_last
    return [
        tuple(sorted((n for n, p in producer.items() if p < k <= last_reader.get(n, -2)),
                     key=order.__getitem__))
        for k in range(len(ios))
    ]


def tied_parameters(gm: torch.fx.GraphModule, ios: list[StageIO]) -> list[dict[int, str]]:
    """Parameters bound by more than one stage (the same ``Parameter`` object, e.g. a
    GPT's tok_emb.weight and lm_head.weight): for each, stage -> the name it binds."""
    by_node = {n.name: n for n in gm.graph.nodes}
    names: dict[int, dict[int, str]] = {}  # id(parameter) -> stage -> name
    first_seen: dict[int, tuple[int, str]] = {}
    for io in ios:
        for node_name in io.nodes:
            node = by_node[node_name]
            found: list[tuple[str, torch.nn.Parameter]] = []
            if node.op == "call_module":
                module = gm.get_submodule(str(node.target))
                found = list(module.named_parameters(str(node.target), remove_duplicate=False))
            elif node.op == "get_attr":
                owner, _, leaf = str(node.target).rpartition(".")
                value = getattr(gm.get_submodule(owner) if owner else gm, leaf)
                if isinstance(value, torch.nn.Parameter):
                    found = [(str(node.target), value)]
            for name, param in found:
                stages = names.setdefault(id(param), {})
                stages[io.index] = min(name, stages.get(io.index, name))
                first_seen.setdefault(id(param), (io.index, name))
    groups = [names[key] for key in sorted(names, key=first_seen.__getitem__)]
    return [dict(sorted(g.items())) for g in groups if len(g) > 1]


def distributed_source(traced: Traced, plan: Plan, ios: list[StageIO],
                       local: list[LocalStage]) -> str:
    """distributed.py; ``local``: what each stage runs split over its TP GPUs."""
    k = plan.num_stages
    doc = [
        f"{plan.model or 'The model'}'s {k} stages on torch.distributed.pipelining, generated",
        "by fxpipe: what the plan decides (the values each stage receives, the tied",
        "parameters), bound to the runtime's DistributedPipeline (runtime/pipelining.py).",
    ]
    wire_table = wires(traced.gm.graph, ios)
    tied = tied_parameters(traced.gm, ios)
    lines = [
        '"""' + "\n".join(doc).replace('"""', "'''") + '\n"""',
        "",
        "from .runner import (",
        "    DEVICE_OF,",
        "    MICROBATCHES,",
        "    PRECISION,",
        "    RECOMPUTE,",
        "    REPLICAS,",
        "    SCHEDULE,",
        "    SHARED_INPUTS,",
        "    build_output,",
        "    flatten_inputs,",
        ")",
        "from .runtime.launch import init_distributed, main, peak_rss_bytes",
        "from .runtime.materialize import parameters_on_meta",
        "from .runtime.pipelining import DistributedPipeline",
        *(f"from .stage{j} import Stage{j}" for j in range(k)),
        "",
        "__all__ = [",
        *(f'    "{name}",' for name in _DISTRIBUTED_EXPORTS),
        "]",
        "",
        *wrap_line(f"STAGE_CLASSES = {tuple_literal(f'Stage{j}' for j in range(k))}"),
        f"SCHEDULE_KIND = {json.dumps(plan.schedule)}",
        "# VIRTUAL_STAGES: stages per rank; with more than one, stage k on rank DEVICE_OF[k]",
        f"VIRTUAL_STAGES = {plan.virtual_stages}",
        "# UNSUPPORTED: why this plan cannot run here (None: it can)",
        *string_constant("UNSUPPORTED", _distributed_limit(plan)),
        *_data_parallel(plan),
        *tensor_parallel_lines(traced.gm, plan, ios, tied, local),
        "# WIRES[k]: the values stage k receives, in this order; a value passes through",
        "# every stage between the one that makes it and the last one that reads it.",
        "WIRES = (",
    ]
    for j, wire in enumerate(wire_table):
        lines.append(f"    # into stage {j}")
        lines += wrap_line(f"    {tuple_literal(json.dumps(v) for v in wire) if wire else '()'},")
    lines += [
        ")",
        "# TIED: parameters bound by several stages, stage -> name; their gradients are",
        "# summed over exactly the ranks of those stages after backward.",
        "TIED = (" if tied else "TIED = ()",
    ]
    for group in tied:
        items = ", ".join(f"{j}: {json.dumps(name)}" for j, name in group.items())
        lines += wrap_line(f"    {{{items}}},")
    if tied:
        lines.append(")")
    footer = _DISTRIBUTED_FOOTER
    if _data_parallel(plan):
        footer = footer.replace("    recompute=RECOMPUTE,\n",
                                "    recompute=RECOMPUTE,\n    data_parallel=DATA_PARALLEL,\n")
    if plan.tp > 1:
        footer = footer.replace("    recompute=RECOMPUTE,\n",
                                "    recompute=RECOMPUTE,\n    tensor_parallel=TENSOR_PARALLEL,\n")
    return "\n".join([*lines, "", footer])


def _data_parallel(plan: Plan) -> list[str]:
    """The ``DATA_PARALLEL`` lines of a plan whose layout runs d > 1 pipelines (none
    without one, so that such a package reads as before layouts)."""
    layout = plan.layout
    if layout is None or layout.dp == 1:
        return []
    return [
        "# DATA_PARALLEL: the plan's layout, (d, mode): d pipelines side by side on a",
        '# ("dp", "pp") DeviceMesh, job rank i * pp + j running rank j of pipeline i, each',
        "# stage's d copies kept equal by torch's FSDP2 (fsdp) or DDP (ddp)",
        f"DATA_PARALLEL = ({layout.dp}, {json.dumps(layout.dp_mode)})",
    ]


_DISTRIBUTED_EXPORTS = (
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
)

_DISTRIBUTED_FOOTER = '''PIPELINE = DistributedPipeline(
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
'''


def _wrap_text(text: str) -> list[str]:
    return textwrap.wrap(text, width=88, break_long_words=False, break_on_hyphens=False)


def _processes(plan: Plan) -> int:
    """The job's processes: the plan's GPUs, every pipeline's under a layout."""
    return plan.num_devices * (plan.layout.dp if plan.layout is not None else 1)


def launch_source(plan: Plan) -> str:
    if plan.v_placed:
        per_process = f"{plan.virtual_stages} pipeline stages per process, in a V"
    elif plan.virtual_stages > 1:
        per_process = (f"{plan.virtual_stages} interleaved pipeline stages per process "
                       f"(stage k on rank k % {plan.num_devices})")
    elif plan.num_devices == plan.num_stages:
        per_process = "one pipeline stage per process"
    else:
        per_process = f"one stage replica per process ({plan.configuration})"
    title = f'"""Train {plan.model or "the model"} under torchrun, {per_process}:'
    needs: list[str] = []  # what torch's class for the schedule needs, as launch prints it
    if plan.schedule in ZERO_BUBBLE:
        sentence, met = requirement(plan.schedule, plan.num_stages, plan.num_devices,
                                    plan.microbatches)
        if not met:
            sentence += ", which this plan does not meet: it stops with the fix"
        needs = [*_wrap_text(sentence + "."), ""]
    return "\n".join([
        *_wrap_text(title),
        "",
        f"    torchrun --nproc-per-node {_processes(plan)} train_torchrun.py "
        "--model model.py \\",
        "        [--checkpoint model.pt] [--steps N] [--lr LR] [--batch FILE] [--save DIR]",
        "        [--measure measured.json]",
        "",
        *needs,
        "gloo on the CPU, NCCL on GPUs; the loss is the model file's loss_fn. With",
        "--checkpoint (a torch.save'd state_dict of the whole model) each rank builds",
        "the model on meta and materializes only its own stage. Generated by fxpipe.",
        '"""',
        "",
        "import importlib.util",
        "import sys",
        "from pathlib import Path",
        "",
        "",
        "def _package():  # this directory as a package, whatever its name",
        "    here = Path(__file__).resolve().parent",
        "    spec = importlib.util.spec_from_file_location(",
        '        "fxpipe_stages", here / "__init__.py", submodule_search_locations=[str(here)]',
        "    )",
        "    module = importlib.util.module_from_spec(spec)",
        "    sys.modules[spec.name] = module",
        "    spec.loader.exec_module(module)",
        "    return module",
        "",
        "",
        'if __name__ == "__main__":',
        "    distributed = _package().distributed",
        "    sys.exit(distributed.main(distributed.PIPELINE, sys.argv[1:]))",
        "",
    ])
