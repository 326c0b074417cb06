"""fxpipe from Python: plan a model built in a notebook or a script, as ``fxpipe split`` does.

    import fxpipe

    plan = fxpipe.split(model, (tokens,), gpus=4, out="gpt-pipe")   # -> fxpipe.plan.Plan
    plan = fxpipe.split_file("examples/gpt.py", gpus=4)              # the model file's
    pipe = fxpipe.load_package("gpt-pipe")                           # the package written

Every option is the command line's (``fxpipe split --help``) under its Python name, and is
checked by the same function (``fxpipe.request.split_options``) before any slow work; a
mistake is one ``ValueError`` naming the option as written here (``virtual_stages=2``).
The plan is the one the command line makes for the same model and options: its
``to_json()`` is the plan.json ``fxpipe split`` writes. Nothing is printed: what the
command prints as notes is in ``plan.notes``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.request import API, read_card, split_options

if TYPE_CHECKING:
    import torch

    from fxpipe.frontend import Traced
    from fxpipe.options import SplitOptions
    from fxpipe.plan import Plan
    from fxpipe.report.card import ReportCard

__all__ = ["split", "split_file"]

DIAGRAMS = ("module", "op")


def split(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    gpus: int,
    memory: str | float | None = None,
    device: str = "h100",
    microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int = 1,
    replicate: bool = False,
    optimizer: str = "adam",
    recompute: str = "auto",
    precision: str | None = None,
    loss_fn: Callable[..., Any] | None = None,
    example_target: Any = None,
    batch_dims: Any = None,
    pp: int | str | None = None,
    gpus_per_node: int | None = None,
    dp_mode: str | None = None,
    global_batch: int | None = None,
    tp: int | str | None = None,
    work_limit: float = 10.0,
    time_limit: float = 120.0,
    measure: bool = False,
    calibrate: str | Path | None = None,
    diagram: str = "module",
    label: str | None = None,
    out: str | Path | None = None,
    force: bool = False,
) -> Plan:
    """Cut ``model`` into pipeline stages for ``gpus`` GPUs and return the plan; with
    ``out``, write the folder ``fxpipe split --out`` writes (all or nothing).

    ``example_inputs`` is one micro-batch, as a model file's ``example_inputs()`` returns
    it: a tuple of positional inputs or a dict of keyword inputs (a lone tensor is taken as
    one positional input). ``loss_fn(output, target)`` and ``example_target``, as in a model
    file, let fxpipe check that the loss is a mean over the samples; ``batch_dims`` is what
    a model file's ``batch_dims()`` returns. ``memory``: per GPU, bytes or a size such as
    ``"80GiB"``. ``label`` names the model in the plan and the report (default: its class;
    the command line's is ``FILE.py:FACTORY``). ``model`` is traced as it is, on its device;
    a ``*-true`` precision of another dtype casts it in place, as ``build_model`` would."""
    from fxpipe.compiler import analyze
    from fxpipe.frontend import ModelSource, trace

    options = split_options(**_split_keywords(locals()), spelling=API)
    _check_diagram(diagram)
    card = read_card(calibrate) if calibrate is not None else None
    if out is not None:
        _check_out(out, force)
    args, kwargs = _as_args_kwargs(example_inputs)
    name = label if label is not None else type(model).__name__
    source = ModelSource(path=Path(name), factory=name, model=model, args=args,
                         kwargs=kwargs, loss_fn=loss_fn, target=example_target,
                         batch_dims=batch_dims)
    phases: dict[str, float] = {}
    with _timed(phases)("tracing"):
        source, traced, chosen = _traced(source, options, trace)
    analyze(traced, device=options.device, precision=chosen, measure=measure,
            progress=_timed(phases))
    return _planned(traced, name, options, card, phases, diagram=diagram, calibrate=calibrate,
                    out=out, force=force)


def split_file(
    path: str | Path,
    *,
    gpus: int,
    memory: str | float | None = None,
    device: str = "h100",
    microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int = 1,
    replicate: bool = False,
    optimizer: str = "adam",
    recompute: str = "auto",
    precision: str | None = None,
    pp: int | str | None = None,
    gpus_per_node: int | None = None,
    dp_mode: str | None = None,
    global_batch: int | None = None,
    tp: int | str | None = None,
    work_limit: float = 10.0,
    time_limit: float = 120.0,
    measure: bool = False,
    calibrate: str | Path | None = None,
    diagram: str = "module",
    out: str | Path | None = None,
    force: bool = False,
) -> Plan:
    """``fxpipe split PATH`` from Python: the model file's model (``model.py`` or
    ``model.py:FACTORY``, docs/model-files.md) planned as ``split`` plans a model, with
    the command line's label and plan."""
    from fxpipe.compiler import analyze_file

    options = split_options(**_split_keywords(locals()), spelling=API)
    _check_diagram(diagram)
    card = read_card(calibrate) if calibrate is not None else None
    if out is not None:
        _check_out(out, force)
    phases: dict[str, float] = {}
    source, traced = analyze_file(str(path), device=options.device,
                                  precision=options.precision, measure=measure,
                                  solvable=True, progress=_timed(phases))
    return _planned(traced, source.label, options, card, phases, diagram=diagram,
                    calibrate=calibrate, out=out, force=force)


def _split_keywords(given: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of ``split`` and ``split_file`` that ``split_options`` checks."""
    names = ("gpus", "memory", "device", "microbatches", "schedule", "virtual_stages",
             "replicate", "optimizer", "recompute", "time_limit", "work_limit", "precision",
             "pp", "gpus_per_node", "dp_mode", "global_batch", "tp")
    return {name: given[name] for name in names}


def _check_diagram(diagram: str) -> None:
    if diagram not in DIAGRAMS:
        raise ValueError(f"diagram takes one of {', '.join(DIAGRAMS)}, got {diagram!r}")


def _check_out(out: str | Path, force: bool) -> None:
    """An ``out`` that could not be written is refused before any slow work."""
    from fxpipe.output import check_out

    check_out(Path(out), force=force)


def _as_args_kwargs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One micro-batch as positional and keyword inputs."""
    import torch

    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    raise ValueError(
        f"example_inputs is a {type(inputs).__name__}; pass one micro-batch as a tuple of "
        "positional inputs or a dict of keyword inputs")


def _traced(source: Any, options: SplitOptions, trace: Callable[..., Traced]
            ) -> tuple[Any, Traced, Any]:
    """The steps of ``compiler.analyze_file`` after it has loaded a file, for a model
    given in memory: the precision it trains at (the model cast for a ``*-true`` one),
    traced (under autocast for a ``*-mixed`` one), refused when too big to solve, and the
    notes the command line gives, in its order. Returns the source (cast), the traced
    model and the precision to analyse at."""
    from fxpipe.compiler import _cast
    from fxpipe.loss_reduction import summed_loss_note
    from fxpipe.partition import check_size
    from fxpipe.passes.base import OP_NODES
    from fxpipe.precision import precision_note, trained_precision

    precision = options.precision
    note = precision_note(precision, source.model)
    precision = trained_precision(precision, source.model) if precision is not None else None
    if precision is not None and not precision.mixed:
        source = _cast(source, precision)
    autocast = precision.dtype if precision is not None and precision.mixed else None
    traced = trace(source.model, source.args, source.kwargs, batch_dims=source.batch_dims,
                   autocast=autocast)
    check_size(sum(1 for n in traced.gm.graph.nodes if n.op in OP_NODES))
    summed = summed_loss_note(source, traced)
    extra = [line for line in (summed, note) if line is not None]
    return source, replace(traced, notes=(*traced.notes, *extra)), precision


def _planned(traced: Traced, label: str, options: SplitOptions, card: ReportCard | None,
             phases: dict[str, float], *, diagram: str, calibrate: str | Path | None,
             out: str | Path | None, force: bool) -> Plan:
    """Plan the analysed model and, with ``out``, write its folder as the command does."""
    from fxpipe.compiler import output_files, plan_split
    from fxpipe.output import write_folder

    plan = plan_split(traced, label=label, options=options,
                      calibrate_from=None if card is None else (card.plan, card.measured),
                      progress=_timed(phases))
    if out is None:
        return plan
    files = output_files(traced, plan, label=label, diagram=diagram, progress=_timed(phases))
    if calibrate is not None:  # kept with the plan it made, as the command keeps it
        files["calibrated_from.json"] = Path(calibrate).read_text()
    timing = {"solver_wall_s": plan.solver.wall_s, "phases_s": phases}
    files["timing.json"] = json.dumps(timing, indent=2) + "\n"
    write_folder(Path(out), files, force=force)
    return plan


def _timed(phases: dict[str, float]) -> Callable[[str], AbstractContextManager[None]]:
    """The driver's ``progress``: each phase's wall seconds into ``phases`` (timing.json),
    under the labels the command line records."""
    @contextmanager
    def phase(label: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        phases[label] = time.perf_counter() - start

    return phase
