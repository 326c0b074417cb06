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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

from fxpipe.request import API, SplitKeywords, read_card, split_options

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
    loss_fn: Callable[..., Any] | None = None,
    example_target: Any = None,
    batch_dims: Any = None,
    label: str | None = None,
    measure: bool = False,
    calibrate: str | Path | None = None,
    diagram: str = "module",
    out: str | Path | None = None,
    force: bool = False,
    **options: Unpack[SplitKeywords],
) -> Plan:
    """Plan ``model`` on ``gpus`` GPUs (the layout searched, as the command line does:
    ``pp=gpus`` is one pipeline on all of them) and return the plan; with ``out``, write
    the folder ``fxpipe split --out`` writes (all or nothing).

    ``example_inputs`` is one micro-batch, as a model file's ``example_inputs()`` returns
    it: a tuple of positional inputs or a dict of keyword inputs (a lone tensor is taken as
    one positional input). ``loss_fn(output, target)`` and ``example_target``, as in a model
    file, let fxpipe check that the loss is a mean over the samples; ``batch_dims`` is what
    a model file's ``batch_dims()`` returns. ``label`` names the model in the plan and the
    report (default: its class; the command line's is ``FILE.py:FACTORY``). ``options``:
    ``gpus`` and the command line's other options (``SplitKeywords``; ``memory``: per GPU,
    bytes or a size such as ``"80GiB"``). ``model`` is traced as it is, on its device; a
    ``*-true`` precision of another dtype casts it in place, as ``build_model`` would."""
    from fxpipe.compiler import analyze_file
    from fxpipe.frontend import ModelSource

    checked, card = _checked(options, diagram=diagram, calibrate=calibrate, out=out,
                             force=force)
    args, kwargs = _as_args_kwargs(example_inputs)
    name = label if label is not None else type(model).__name__
    source = ModelSource(path=Path(name), factory=name, model=model, args=args,
                         kwargs=kwargs, loss_fn=loss_fn, target=example_target,
                         batch_dims=batch_dims)
    phases: dict[str, float] = {}
    _, traced = analyze_file(source, device=checked.device, precision=checked.precision,
                             measure=measure, solvable=True, progress=_timed(phases))
    return _planned(traced, name, checked, card, phases, diagram=diagram, calibrate=calibrate,
                    out=out, force=force)


def split_file(
    path: str | Path,
    *,
    measure: bool = False,
    calibrate: str | Path | None = None,
    diagram: str = "module",
    out: str | Path | None = None,
    force: bool = False,
    **options: Unpack[SplitKeywords],
) -> Plan:
    """``fxpipe split PATH`` from Python: the model file's model (``model.py`` or
    ``model.py:FACTORY``, docs/model-files.md) planned as ``split`` plans a model, with
    the command line's label and plan."""
    from fxpipe.compiler import analyze_file

    checked, card = _checked(options, diagram=diagram, calibrate=calibrate, out=out,
                             force=force)
    phases: dict[str, float] = {}
    source, traced = analyze_file(str(path), device=checked.device,
                                  precision=checked.precision, measure=measure,
                                  solvable=True, progress=_timed(phases))
    return _planned(traced, source.label, checked, card, phases, diagram=diagram,
                    calibrate=calibrate, out=out, force=force)


def _checked(options: SplitKeywords, *, diagram: str, calibrate: str | Path | None,
             out: str | Path | None, force: bool) -> tuple[SplitOptions, ReportCard | None]:
    """Every keyword checked before any slow work: the options (``split_options``), the
    diagram, the measurement to calibrate from (read back) and ``out``."""
    checked = split_options(**options, spelling=API)
    if diagram not in DIAGRAMS:
        raise ValueError(f"diagram takes one of {', '.join(DIAGRAMS)}, got {diagram!r}")
    card = read_card(calibrate) if calibrate is not None else None
    if out is not None:
        from fxpipe.output import check_out

        check_out(Path(out), force=force)
    return checked, card


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
