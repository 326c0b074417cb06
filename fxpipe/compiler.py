"""The compiler's phases end to end, as library calls.

    source, traced = analyze_file("model.py", device=get_device("h100"))  # load, trace,
                                                          # passes + a cost model
    plan = plan_split(traced, label=source.label, options=SplitOptions(gpus=8, ...))
    # or re-made with the costs a training step measured of an earlier plan (calibration.py):
    plan = plan_split(traced, ..., calibrate_from=(old, load_measured("measured.json")))
    files = output_files(traced, plan, label=source.label)  # plan.json, stages, diagrams

The CLI, the benchmarks and the tests all drive fxpipe through these calls, so
the sequence frontend → passes → cost models → lower → partition → codegen / report
is written once (``analyze_file`` also takes a model built in memory, ``analyze`` one
already traced). ``plan_split`` is options → (the cluster's layout, cluster.py) → lower →
partition (where nothing fits, what would, advice.py) → build_plan, with calibration.py
around it. ``progress`` wraps each slow phase (the CLI shows a spinner); ``notify``
receives what a person may want to know on the way (which tracer captured the model, its
notes).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from fxpipe import advice, calibration, cluster
from fxpipe.codegen import generate
from fxpipe.codegen.build_check import check_builds
from fxpipe.codegen.package import pairs_run_whole
from fxpipe.cost_models import Device, analytic, measured
from fxpipe.frontend import ModelSource, Traced, load_model_file, trace_source
from fxpipe.loss_reduction import summed_loss_note
from fxpipe.lower import Lowered, lower
from fxpipe.options import SplitOptions, execution, options_of
from fxpipe.partition import (
    InfeasibleMemoryError,
    Partition,
    PipedreamTieError,
    Problem,
    TiedPolicy,
    check_size,
    exact_groups,
    partition,
    shortest_step,
)
from fxpipe.partition.layout import sharded
from fxpipe.passes import annotate_all
from fxpipe.passes.base import OP_NODES
from fxpipe.plan import DynamicDim, Plan
from fxpipe.planning import build_plan
from fxpipe.precision import Precision, default_precision, precision_note, trained_precision
from fxpipe.profile import auto_depth
from fxpipe.report import (
    DiagramError,
    partition_dot,
    render_html,
    render_report,
    render_svg,
    schedule_svg,
)
from fxpipe.runtime.measured_file import Measured
from fxpipe.schedules import ScheduleKind

__all__ = ["SplitOptions", "analyze", "analyze_file", "options_of", "output_files", "plan_split"]

Progress = Callable[[str], AbstractContextManager[object]]


def _silent(label: str) -> AbstractContextManager[object]:
    return nullcontext()


def _ignore(line: str) -> None:
    pass


def analyze_file(
    spec: str | ModelSource,
    *,
    device: Device,
    precision: Precision | None = None,
    measure: bool = False,
    solvable: bool = False,
    progress: Progress = _silent,
    notify: Callable[[str], None] = _ignore,
) -> tuple[ModelSource, Traced]:
    """Load a model file (``model.py`` or ``model.py:FACTORY``), trace it at the precision
    it trains at and ``analyze`` it: the model as the file builds it, and its graph with
    every node costed. A ``ModelSource`` is a model loaded already (``fxpipe.split``'s,
    built in memory), traced and analysed the same way.

    The source returned is the model as traced (cast in place for a ``*-true`` precision
    of another dtype); ``notify`` is told the tracer and the notes. ``solvable``: the graph
    is to be split, so one too big for the solver is refused right after tracing
    (``check_size``), before the passes spend minutes on it, and a loss summed over the
    samples is noted."""
    if isinstance(spec, str):
        with progress(f"loading {spec}"):
            source = load_model_file(spec)
    else:
        source = spec
    note = precision_note(precision, source.model)  # 32-true of a float64 model: 64-true
    precision = trained_precision(precision, source.model) if precision is not None else None
    if precision is not None and not precision.mixed:
        source = _cast(source, precision)
    with progress("tracing"):  # a *-mixed model traced under its autocast (frontend.py)
        traced = trace_source(source, autocast=precision.dtype if precision is not None
                              and precision.mixed else None)
    if solvable:
        check_size(sum(1 for n in traced.gm.graph.nodes if n.op in OP_NODES))
        summed = summed_loss_note(source, traced)  # a pipeline's loss is a mean of M
        if summed is not None:
            traced = replace(traced, notes=(*traced.notes, summed))
    if note is not None:
        traced = replace(traced, notes=(*traced.notes, note))
    how = traced.tracer
    if traced.fallback_reason:  # the normal path for Hugging Face models, not a failure
        how = f"torch.export (symbolic_trace could not capture it: {traced.fallback_reason})"
    notify(f"traced with {how}; {len(traced.gm.graph.nodes)} nodes")
    for note in traced.notes:
        notify(f"note: {note}")
    analyze(traced, device=device, precision=precision, measure=measure, progress=progress)
    return source, traced


def _cast(source: ModelSource, precision: Precision) -> ModelSource:
    """The model as a ``*-true`` precision trains it, to be traced so: cast in place with
    ``model.to(dtype)``, as the user casts it before ``build_stages``, and its floating
    inputs with it. torch.export writes the dtypes it traces into the graph (a Llama
    RMSNorm's ``x.to(input_dtype)`` becomes ``to(float32)``, which a bfloat16 model would
    not run), so only a trace of the cast model is what the cast model runs."""
    if default_precision(source.model) is precision:
        return source
    dtype = precision.dtype
    source.model.to(dtype)
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
        (source.args, source.kwargs))
    return replace(source, args=args, kwargs=kwargs)


def analyze(
    traced: Traced,
    *,
    device: Device,
    precision: Precision | None = None,
    measure: bool = False,
    progress: Progress = _silent,
) -> Traced:
    """Annotate every node: shapes, modules, FLOPs, bytes, and time (roofline or measured).

    The graph is analysed as ``device`` runs it (its fused attention kernels) at
    ``precision`` (default: the model's parameter dtype). A ``*-true`` precision of
    another dtype than a torch.export graph's is refused: the graph holds the casts of the
    dtype it was traced at (``analyze_file`` traces the model cast). ``64-true`` and
    ``32-true`` cost the model at its own dtype, which they train it in
    (``trained_precision``)."""
    traced_at = default_precision(traced.gm)
    if precision is not None:
        precision = trained_precision(precision, traced.gm)
    if (traced.tracer == "export" and precision is not None and not precision.mixed
            and precision is not traced_at):
        raise ValueError(
            f"the graph was captured by torch.export at {traced_at.value} and holds that "
            f"precision's casts; to plan {precision.value}, trace the model cast with "
            f"model.to({precision.dtype}) (and its floating inputs), as analyze_file does"
        )
    with progress("shapes, FLOPs and bytes"):
        annotate_all(traced.gm, *traced.flat_inputs, execution=execution(device, precision))
    if measure:
        if precision is not None and precision is not default_precision(traced.gm):
            warnings.warn(
                f"--measure times every node at the model's own dtype, not at precision "
                f"{precision.value}; the bytes follow {precision.value}, the times do not",
                stacklevel=2,
            )
        on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in traced.flat_inputs)
        kind: Literal["cpu", "cuda"] = "cuda" if on_cuda else "cpu"
        with progress(f"timing every node ({kind})"):
            measured.annotate_times(traced.gm, *traced.flat_inputs, device=kind)
    else:
        with progress(f"roofline times for {device.name}"):
            analytic.annotate_times(traced.gm, device)
    return traced


def plan_split(
    traced: Traced,
    *,
    label: str,
    options: SplitOptions,
    progress: Progress = _silent,
    calibrate_from: tuple[Plan, Measured] | None = None,
) -> Plan:
    """Cut an analysed model into ``options.gpus`` stages: the options (and, asked for, the
    layout of the GPUs the cluster search chooses), lower, partition (where nothing fits,
    what would: ``advice``), and the answer applied to the graph (``build_plan``).

    PipeDream's weight stashing updates each stage's own weights after every micro-batch,
    so a parameter read by several ops (tied) stays on one stage under that schedule.

    ``calibrate_from``: an earlier plan of this model and a measurement of it (measured.json
    as read back); its measured stage times rescale the node costs (in place) before
    lowering, and the answer is never worse, under those costs, than the measured plan's
    own cut (``calibration``)."""
    pipedream = options.schedule is ScheduleKind.PIPEDREAM
    notes: list[str] = []
    note = precision_note(options.precision, traced.gm)
    if note is not None and note not in traced.notes:  # (analyze_file's notes hold it)
        notes.append(note)
    # costed, and recorded, at the precision the run trains in, as analyze() costed it
    options = replace(options, precision=trained_precision(options.precision, traced.gm))
    if calibrate_from is not None:
        notes.append(calibration.calibrate_graph(traced.gm, *calibrate_from))
        # the costs are measured: at their own speed, whatever efficiency was assumed
        options = replace(options, compute_efficiency=1.0, cluster=None if options.cluster
                          is None else replace(options.cluster, compute_efficiency=1.0))
    # the graph lowered for some options, once for the options its nodes depend on (the
    # layouts'); advice lowers the graph as it is annotated at each call
    lowered_for = functools.partial(_lowered, traced, lowerings={})
    problem = functools.partial(_problem, traced)
    layout = None
    solved: dict[SplitOptions, Partition] = {}
    if options.cluster is not None:
        with progress(f"choosing the layout of {options.gpus} GPUs"):
            try:
                options, layout = cluster.choose(
                    traced, options, problem=lambda o: lowered_for(o).problem,
                    solve=functools.partial(_solve, lowered_for, solved),
                    calibrated=calibrate_from is not None)
            except cluster.NoLayoutFits as exc:  # what fits the leanest, the graph costed again
                raise advice.advised_layout(exc, traced, problem=problem) from None
    lowered = lowered_for(options)
    if pipedream and lowered.problem.tied:
        _check_pipedream_ties(lowered.problem)
    with progress(f"solving ({len(lowered.problem.nodes)} nodes onto {options.gpus} GPUs)"):
        try:
            result = solved.get(options) or _solve(lowered_for, {}, options)
        except InfeasibleMemoryError as exc:  # what would fit, the graph costed again
            raise advice.advised(exc, traced, options, problem=problem) from None
    evaluation = result.evaluation
    if calibrate_from is not None:
        evaluation, line = calibration.against_measured(lowered, result.problem, evaluation,
                                                        calibrate_from[0])
        notes.append(line)
    notes = [*traced.notes, *notes]
    if result.report.wall_clock_stopped:
        notes.append(
            f"The solver was stopped by the wall-clock limit (--time-limit "
            f"{options.time_limit_s:g} s) before its work limit; the plan may differ run to "
            f"run. Raise --time-limit, or lower --work-limit, for a reproducible plan.")
    if traced.fallback_reason:
        notes.append(f"captured with torch.export, the usual path for Hugging Face models "
                     f"(symbolic_trace could not: {traced.fallback_reason})")
    if traced.shared_inputs:
        notes.append(
            f"inputs without a batch dimension, handed whole to every micro-batch: "
            f"{', '.join(traced.shared_inputs)} ({traced.batching})"
        )
    plan = build_plan(
        lowered,
        result.problem,
        evaluation,
        result.report,
        baselines=result.baselines,
        model=label,
        tracer=traced.tracer,
        device=options.device.name,
        optimizer=options.optimizer,
        precision=(options.precision or default_precision(traced.gm)).value,
        notes=notes,
        dynamic_dims=dynamic_dims(traced),
        shared_inputs=traced.shared_inputs,
        layout=layout,
    )
    whole = pairs_run_whole(traced.gm, plan)
    if whole:  # the plan divides their work by t; say so, it is not what runs
        assert layout is not None
        plan = replace(plan, notes=(*plan.notes, (
            f"{len(whole)} of {layout.tp_pairs} tensor-parallel pairs run whole on each of "
            f"the {layout.tp} GPUs of their stage (an op between them the stage code cannot "
            f"split on local shares, or a weight a tie keeps whole: {', '.join(whole[:4])}"
            f"{', ...' * (len(whole) > 4)}), where the plan divides their work by "
            f"{layout.tp}: those stages take longer and hold more than predicted")))
    return plan


def _solve(lowered_for: Callable[[SplitOptions], Lowered],
           solved: dict[SplitOptions, Partition], options: SplitOptions, *,
           advise: bool = True, quick: bool = False, bound_s: float | None = None,
           hint: tuple[int, ...] | None = None, count_gpus: bool = True) -> Partition:
    """``partition`` of the model lowered for ``options``, kept in ``solved`` (unless
    ``quick``); ``advise``, ``quick``, ``bound_s``, ``hint`` and ``count_gpus`` as
    ``partition`` takes them."""
    result = shortest_step(partition(
        lowered_for(options).problem, work_limit=options.work_limit,
        time_limit_s=options.time_limit_s, replicate=options.replicate, advise=advise,
        quick=quick, bound_s=bound_s, hint=hint, count_gpus=count_gpus))
    if not quick:
        solved[options] = result
    return result


def _problem(traced: Traced, options: SplitOptions) -> Problem:
    """The solver's problem of the analysed graph, for ``options``."""
    return _lowered(traced, options).problem


def _lowered(traced: Traced, options: SplitOptions,
             lowerings: dict[SplitOptions, Lowered] | None = None) -> Lowered:
    """The analysed graph as the solver's problem, for ``options`` (each stage's ops split
    over a layout's TP degree, ``partition.tensor_parallel``, and the optimizer state
    divided over its data-parallel copies, ``partition.layout.sharded``). ``lowerings``
    keeps one lowering per set of options the nodes' costs depend on: the layouts of a
    search differ in GPUs, micro-batches, memory and copies, which set only the problem's
    own fields (``_LAYOUT_FIELDS``)."""
    lowerings = {} if lowerings is None else lowerings
    key = replace(options, **_LAYOUT_FIELDS)
    held = lowerings.get(key)
    if held is None:
        held = lowerings[key] = _lower(traced, options)
    else:
        held = replace(held, problem=replace(
            held.problem, num_stages=options.gpus * options.virtual_stages,
            num_devices=options.gpus, microbatches=options.microbatches,
            memory_limit=options.memory_limit))
    return replace(held, problem=sharded(held.problem, *options.data_parallel))


# the options a lowering's Problem takes as its own fields, not into its nodes' costs
_LAYOUT_FIELDS: dict[str, Any] = {"gpus": 1, "microbatches": 1, "memory_limit": 0.0,
                                  "data_parallel": (1, "ddp")}


def _lower(traced: Traced, options: SplitOptions) -> Lowered:
    """``lower`` of the analysed graph for ``options``."""
    pipedream = options.schedule is ScheduleKind.PIPEDREAM
    return lower(
        traced.gm,
        num_stages=options.gpus * options.virtual_stages,
        virtual_stages=options.virtual_stages,
        num_devices=options.gpus,
        device=options.device,
        memory_limit=options.memory_limit,
        schedule=options.schedule,
        microbatches=options.microbatches,
        optimizer=options.optimizer,
        recompute=options.recompute,
        block_depth=auto_depth(traced.gm),
        tied_policy=TiedPolicy.COLOCATE if pipedream else TiedPolicy.COPY,
        across_hosts=options.across_hosts,
        tensor_parallel=options.tensor_parallel,
        compute_efficiency=options.compute_efficiency,
    )


def _check_pipedream_ties(problem: Problem) -> None:
    """Refuse, with the reason, a tie that keeps more of the model on one stage than a
    balanced split would give it (a GPT's embedding and LM head: nearly all of it)."""
    exact = exact_groups(problem)
    time = [n.forward_s + n.backward_s for n in problem.nodes]
    total = sum(time) or 1.0
    K = problem.num_stages
    for tied in problem.tied:
        group = exact.groups[exact.group_of[tied.nodes[0]]]
        share = sum(time[v] for v in group) / total
        if share > 1 / K or exact.num_coarse < K:
            raise PipedreamTieError(name=tied.name, share=share, stages=K)


def dynamic_dims(traced: Traced) -> list[DynamicDim]:
    """The traced inputs' free dimensions, as the plan records them."""
    return [
        DynamicDim(shape.name, d, shape.shape[d], *free)
        for shape in traced.inputs
        for d, free in enumerate(shape.dynamic)
        if free is not None
    ]


def output_files(
    traced: Traced,
    plan: Plan,
    *,
    label: str,
    diagram: str = "module",
    progress: Progress = _silent,
    notify: Callable[[str], None] = _ignore,
) -> dict[str, str | bytes]:
    """Every file of the output folder but timing.json: plan, report, diagrams, package.
    A diagram Graphviz fails to draw is left out, and ``notify`` told why. The package's
    stages are built against the traced model first (``check_builds``): one that does
    not build is a ``PackageBuildError``, and nothing is returned to write."""
    dot = partition_dot(
        traced.gm,
        plan.stage_of(),
        num_stages=plan.num_stages,
        level=diagram,
        depth=auto_depth(traced.gm),
        title=label,
    )
    files: dict[str, str | bytes] = {"plan.json": plan.to_json(), "partition.dot": dot}
    with progress("drawing the diagrams and writing the stage modules"), \
            ThreadPoolExecutor(max_workers=1) as graphviz:
        drawing = graphviz.submit(render_svg, dot)  # dot's own process draws meanwhile
        files["schedule.svg"] = schedule_svg(plan)
        package = generate(traced, plan)
        if traced.model is not None:  # a package that cannot be built is never written
            check_builds(package, traced.model)
        files.update(package)
        try:
            svg = drawing.result()
        except DiagramError as exc:  # the plan and the stages stand without the drawing
            svg = None
            notify(f"Graphviz's dot could not draw partition.svg ({exc}); partition.dot "
                   "holds the diagram")
    if svg is not None:
        files["partition.svg"] = svg
    files["report.md"] = render_report(plan, svg=svg is not None)  # links what exists
    files["report.html"] = render_html(plan, traced.gm, depth=auto_depth(traced.gm),
                                       schedule=files["schedule.svg"])
    return files
