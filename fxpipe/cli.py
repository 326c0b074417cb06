"""The ``fxpipe`` command: ``profile`` a model, ``split`` it into pipeline stages, ``report``
how a plan measured against its predictions, ``merge`` stage checkpoints."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import (
    AbstractContextManager,
    contextmanager,
    nullcontext,
    redirect_stdout,
    suppress,
)
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rich.console import Console
from rich.table import Table

from fxpipe import cli_flags
from fxpipe.cli_flags import UsageError
from fxpipe.units import format_seconds

if TYPE_CHECKING:
    from fxpipe.partition import InfeasibleMemoryError, Recompute
    from fxpipe.plan import Layout, Plan

__all__ = ["main", "run"]

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1

err = Console(stderr=True, highlight=False)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; every way it ends is one line on stderr and an exit status:
    0 done, 2 a mistake fxpipe detected, 130/143 SIGINT/SIGTERM, 1 a bug in fxpipe."""
    from fxpipe.signals import Interrupted, handle_signals

    debug = bool(os.environ.get("FXPIPE_DEBUG"))
    _one_line_warnings()
    try:
        with handle_signals(_stop_searches):
            return _main(argv)
    except ValueError as exc:  # every user mistake fxpipe detects is a ValueError subclass
        if debug:
            raise
        message = " ".join(_worded(exc).split())
        print(f"fxpipe: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (Interrupted, KeyboardInterrupt) as exc:
        which = exc.name if isinstance(exc, Interrupted) else "SIGINT"
        notes = getattr(exc, "__notes__", [])
        outcome = "; ".join(notes) or "nothing was written, a previous --out is as it was"
        print(f"fxpipe: interrupted by {which}; {outcome}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, Interrupted) else 130
    except Exception as exc:
        if debug:
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        print(
            f"fxpipe: internal error: {type(exc).__name__}: {first}; this is a bug in fxpipe, "
            "not in your model: please report it with the traceback FXPIPE_DEBUG=1 prints",
            file=sys.stderr,
        )
        return EXIT_INTERNAL_ERROR
    except BaseException as exc:  # sys.exit, or a BaseException of the model's own
        from fxpipe import model_exits

        escaped = None if debug else model_exits.worded(exc)
        if escaped is None:  # --help's exit, or fxpipe's own
            raise
        print(f"fxpipe: error: {escaped}", file=sys.stderr)
        return EXIT_USER_ERROR


def run() -> NoReturn:
    """The console script: :func:`main`, then leave without tearing the interpreter down.

    Freeing a traced model's graphs and torch's state at exit took 2 s of a 20 s split of
    Llama-3-8B. Every file fxpipe writes is closed by the time ``main`` returns, so only
    the standard streams need flushing.

    The process is fxpipe's alone, so the cyclic garbage collector is set for a run that
    builds a few big object graphs and keeps them to the end: the youngest generation is
    collected every 50,000 allocations rather than 700, and what exists after each step
    (the libraries, the model, its graph) is frozen out of later full collections. On a
    split of transformers' Llama-3-8B the collector took 1.8 s and then 0.4 s, and the
    whole run 2-3 s less (BENCHMARKS.md); peak memory stayed the same."""
    global _FREEZE_AFTER_EACH_STEP
    gc.set_threshold(50_000, 20, 20)
    _FREEZE_AFTER_EACH_STEP = True
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(code)


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args, extra = cli_flags.parse(parser, argv)
    if extra:  # found by the top-level parser, but the command's --help lists the flags
        prog = f"fxpipe {args.command}" if getattr(args, "command", None) else "fxpipe"
        raise UsageError(f"unrecognized arguments: {' '.join(extra)}; see '{prog} --help'")
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_USER_ERROR
    code: int = args.run(args)
    return code


def _one_line_warnings() -> None:
    """fxpipe's own warnings as one line on stderr, as its errors are; others (torch's, a
    model's) as Python shows them, with where they come from."""
    warnings.formatwarning = _warning_line


_PYTHON_FORMAT = warnings.formatwarning
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warning_line(message: Warning | str, category: type[Warning], filename: str,
                  lineno: int, line: str | None = None) -> str:
    if os.path.abspath(filename).startswith(_PACKAGE):
        return f"fxpipe: warning: {' '.join(str(message).split())}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)


def _stop_searches() -> None:
    """On SIGINT/SIGTERM, from the signal watcher thread: stop a CP-SAT search in
    progress, so the signal is handled now rather than when the time limit runs out."""
    ilp = sys.modules.get("fxpipe.partition.ilp")
    if ilp is not None:
        ilp.stop_searches()


def _parser() -> argparse.ArgumentParser:
    return cli_flags.parser({"profile": _run_profile, "split": _run_split,
                             "report": _run_report, "merge": _run_merge})


PHASES: dict[str, float] = {}  # step label -> wall seconds of this run, for timing.json
_FREEZE_AFTER_EACH_STEP = False  # set by run(), whose process is fxpipe's alone


@contextmanager
def _step(label: str, quiet: bool) -> Iterator[None]:
    """Show a spinner while a step runs (on a terminal) and record how long it took."""
    start = time.perf_counter()
    if quiet or not err.is_terminal:
        yield
    else:
        with err.status(label):
            yield
    PHASES[label] = time.perf_counter() - start
    if _FREEZE_AFTER_EACH_STEP:
        gc.freeze()
    if not quiet and err.is_terminal:
        err.print(f"[green]✓[/] {label} ({format_seconds(PHASES[label])})")


def analyze_model(
    spec: str,
    *,
    device: str,
    precision: str | None = None,
    measure: bool = False,
    quiet: bool = False,
    solvable: bool = False,
) -> tuple[Any, Any]:
    """The driver's load → trace → analyze, with a spinner per phase and what it learnt
    (the tracer, its notes) printed: on a terminal beside the progress, in a pipe on
    stdout, so stderr holds only errors. ``quiet``: nothing of that, and the model file's
    own prints go to stderr (stdout carries JSON). ``solvable``: a graph too big to split
    is refused right after tracing."""
    from fxpipe.compiler import analyze_file
    from fxpipe.cost_models import get_device
    from fxpipe.precision import parse_precision

    target = get_device(device)  # an unknown device fails before any slow work
    chosen = parse_precision(precision) if precision is not None else None
    say = err.print if err.is_terminal else print

    def notify(line: str) -> None:
        if not quiet:
            say(f"  {line}")

    with redirect_stdout(sys.stderr) if quiet else nullcontext():
        return analyze_file(spec, device=target, precision=chosen, measure=measure,
                            solvable=solvable, progress=lambda label: _step(label, quiet),
                            notify=notify)


def _run_profile(args: argparse.Namespace) -> int:
    from fxpipe.profile import summarize
    from fxpipe.units import format_bytes, format_count

    _, traced = analyze_model(args.model, device=args.device, precision=args.precision,
                              measure=args.measure, quiet=args.json)
    if args.depth is not None and args.depth < 1:
        raise ValueError(f"--depth must be at least 1, got {args.depth}")
    rows, total = summarize(traced.gm, by=args.by, depth=args.depth)
    if args.json:
        payload = {
            "model": args.model,
            "tracer": traced.tracer,
            "device": args.device,
            "by": args.by,
            "rows": [r.as_dict() for r in rows],
            "total": total.as_dict(),
        }
        print(json.dumps(payload, indent=2))
        return 0
    table = Table(title=f"{args.model} on {args.device} (one micro-batch)")
    columns: list[tuple[str, Callable[[Any], str]]] = [
        ("ops", lambda r: str(r.nodes)),
        ("fwd FLOPs", lambda r: format_count(r.flops_forward)),
        ("bwd FLOPs", lambda r: format_count(r.flops_backward)),
        ("params", lambda r: format_bytes(r.param_bytes)),
        ("activations", lambda r: format_bytes(r.activation_bytes)),
        ("fwd time", lambda r: format_seconds(r.forward_s)),
        ("bwd time", lambda r: format_seconds(r.backward_s)),
    ]
    table.add_column(args.by)
    for title, _ in columns:
        table.add_column(title, justify="right")
    for row in rows:
        table.add_row(row.name, *(fmt(row) for _, fmt in columns))
    table.add_section()
    table.add_row("total", *(fmt(total) for _, fmt in columns), style="bold")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def _run_split(args: argparse.Namespace) -> int:
    from fxpipe.compiler import output_files, plan_split
    from fxpipe.output import check_out, write_folder
    from fxpipe.report import summary_rows
    from fxpipe.request import split_options
    from fxpipe.units import format_bytes

    # Every flag is checked before any slow work.
    options = split_options(
        gpus=args.gpus, memory=args.memory, device=args.device,
        microbatches=args.microbatches, schedule=args.schedule,
        virtual_stages=args.virtual_stages, replicate=args.replicate,
        optimizer=args.optimizer, recompute=args.recompute, time_limit=args.time_limit,
        work_limit=args.work_limit, precision=args.precision, pp=args.pp,
        gpus_per_node=args.gpus_per_node, dp_mode=args.dp_mode,
        global_batch=args.global_batch, tp=args.tp)
    limit = options.memory_limit

    card = _card(None, args.calibrate) if args.calibrate is not None else None
    out = Path(args.out)
    check_out(out, force=args.force)  # an --out that cannot be written fails now, not later

    source, traced = analyze_model(
        args.model, device=args.device, precision=args.precision, measure=args.measure,
        solvable=True,
    )
    def progress(label: str) -> AbstractContextManager[None]:
        return _step(label, False)

    plan = plan_split(traced, label=source.label, options=options, progress=progress,
                      calibrate_from=None if card is None else (card.plan, card.measured))
    drawing: list[str] = []
    files = output_files(traced, plan, label=source.label, diagram=args.diagram,
                         progress=progress, notify=drawing.append)
    if args.calibrate is not None:  # kept with the plan it made (--out may be its folder)
        files["calibrated_from.json"] = Path(args.calibrate).read_text()
    timing = {"solver_wall_s": plan.solver.wall_s, "phases_s": PHASES}
    files["timing.json"] = json.dumps(timing, indent=2) + "\n"
    written = write_folder(out, files, force=args.force)
    for line in drawing:
        print(f"  note: {line}")
    if "partition.svg" not in files and not drawing:
        print("  note: Graphviz's dot is not installed, so partition.svg was not drawn "
              "(apt-get install graphviz); partition.dot holds the diagram")

    table = Table(
        title=f"{source.label}: {_shape(plan)}, {plan.schedule}, M={plan.microbatches}"
        f"{' per pipeline' * (plan.layout is not None and plan.layout.dp > 1)}, "
        f"limit {format_bytes(limit)}"
    )
    for column in ("partition", "bottleneck", "iteration", "max memory", "fits"):
        table.add_column(column, justify="left" if column == "partition" else "right")
    for row in summary_rows(plan):
        table.add_row(*row)
    console = Console(width=None if sys.stdout.isatty() else 160)
    if plan.layout is not None and len(plan.layout.considered) > 1:
        console.print(_layouts_table(plan.layout))
    if plan.num_stages > 1:  # one stage: no cut to compare with the baselines'
        console.print(table)
    else:
        console.print(f"{table.title}: the whole model on each GPU, nothing to cut")
    solver = plan.solver
    print(
        f"solver {solver.status}, gap {solver.gap:.2%}, {format_seconds(solver.wall_s)}; "
        f"wrote {out}/{_linked(out, written)} ({_opened(files)})"
    )
    return 0


def _opened(files: dict[str, Any]) -> str:
    """The files of the output a person opens, and how many there are in all: the
    runtime's copy alone is some thirty files no one reads."""
    stages = sum(1 for name in files if name.startswith("stage") and name.endswith(".py"))
    shown = [name for name in ("report.html", "report.md", "plan.json") if name in files]
    return (f"{', '.join(shown)} and {stages} stage module{'s' * (stages != 1)}; "
            f"{len(files)} files in all")


def _linked(out: Path, written: Path) -> str:
    """Where a link at ``--out`` led the folder written: ", the folder it links to, X/"."""
    from fxpipe.output import display_path

    if written == Path(os.path.abspath(out)):
        return ""
    return f", the folder it links to, {display_path(written)}/"


def _card(plan_dir: str | None, measured: str) -> Any:
    """The report card of ``measured`` against the plan.json in ``plan_dir`` (default: the
    folder of ``measured``); a warning of the comparison is one line on stderr."""
    from fxpipe.request import read_card

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compared = read_card(measured, plan_dir)
    for warning in caught:
        print(f"fxpipe: warning: {' '.join(str(warning.message).split())}", file=sys.stderr)
    return compared


def _run_report(args: argparse.Namespace) -> int:
    from fxpipe.report.card import render_card

    card = _card(args.plan_dir, args.measured)
    if args.model is None:
        print(render_card(card), end="")
        return 0
    from fxpipe.compiler import options_of, plan_split

    options = options_of(card.plan)
    source, traced = analyze_model(args.model, device=options.device.name,
                                   precision=card.plan.precision, quiet=True)
    # refuses a model that is not the measured plan's before anything is printed
    again = plan_split(traced, label=source.label, options=options,
                       calibrate_from=(card.plan, card.measured))
    before, after = card.plan.stage_of(), again.stage_of()
    moved = sum(before.get(name) != k for name, k in after.items())
    verdict = (f"{moved} of {len(after)} nodes move to another stage" if moved
               else "no cut moves")
    print(render_card(card), end="")
    print(f"Re-planned {source.label} with these measurements: {verdict}; predicted "
          f"bottleneck {format_seconds(again.estimate.bottleneck_s)} under the "
          f"calibrated costs (`fxpipe split ... --calibrate` writes that plan).")
    return 0


def _layouts_table(layout: Layout) -> Table:
    """The layouts the search considered, the chosen one first (report.md's table)."""
    from fxpipe.report.layouts import layout_sentence, layout_table

    proved = "proved the fastest" if layout.proved else "the fastest found"
    searched = sum(row.status != "by hand" for row in layout.considered)
    table = Table(title=f"layout: {layout_sentence(layout)}, {proved} of {searched}")
    columns, rows = layout_table(layout)
    for column in columns:
        table.add_column(column, justify="left" if column in ("mode", "outcome") else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _shape(plan: Plan) -> str:
    """How the plan uses the GPUs, for the summary's title: "4 stages", "4 stages (2-1-1 on
    4 GPUs)" with replicated stages, "2 stages x 4 data-parallel (fsdp)" for a layout (its
    M is per pipeline)."""
    stages = f"{plan.num_stages} stage{'s' * (plan.num_stages != 1)}"
    layout = plan.layout
    if layout is not None:
        gpus = f" on {layout.pp} GPUs" if layout.pp != plan.num_stages else ""  # v a GPU
        split = f" x tp {layout.tp}" if layout.tp > 1 else ""
        return f"{stages}{gpus}{split} x {layout.dp} data-parallel ({layout.dp_mode})"
    if all(stage.replicas == 1 for stage in plan.stages):
        return stages
    return f"{stages} ({plan.configuration} on {plan.num_devices} GPUs)"


def _recompute(value: str) -> Recompute:
    """--recompute's value (a bare --recompute means full)."""
    from fxpipe.request import recompute_of

    return recompute_of(value)


def _run_merge(args: argparse.Namespace) -> int:
    import os
    import tempfile
    from pathlib import Path

    import torch

    from fxpipe.codegen import check_stage_states, merge_stage_state_dicts
    from fxpipe.request import read_plan
    from fxpipe.runtime.checkpoint import read_stage_state

    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder, not a checkpoint file; name the file to "
                         f"write, e.g. --out {out / 'model.pt'}")
    states = []
    for name in args.stages:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"{path}: no such file; pass the stage checkpoints torch.save wrote")
        states.append(read_stage_state(path))
    tied: list[tuple[str, ...]] = []  # keys that are one parameter (none known without a plan)
    if args.plan is not None:
        plan = read_plan(Path(args.plan), "the plan these stages were generated from")
        check_stage_states(states, [stage.parameters for stage in plan.stages], args.stages,
                           keys=[key for group in plan.state_keys for key in group])
        tied = [group for group in plan.state_keys
                if len(group) > 1 or any(key in plan.tied for key in group)]
    merged = merge_stage_state_dicts(states, tied)
    scratch = ""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        handle, scratch = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
        os.close(handle)
        torch.save(merged, scratch)
        os.replace(scratch, out)  # all or nothing
    except OSError as exc:
        raise ValueError(f"cannot write {out}: {exc.strerror or exc}; choose an --out in a "
                         "folder you can write") from None
    finally:
        if scratch and os.path.exists(scratch):
            os.remove(scratch)
    checked = ("" if args.plan is not None
               else " (pass --plan DIR to check that every stage is here and tied copies "
                     "agree)")
    print(f"merged {len(states)} stages, {len(merged)} tensors, into {out}{checked}")
    return 0


def _worded(exc: ValueError) -> str:
    """The message for the user of this command: the solver's errors carry their figures
    (stages, bytes, seconds) and are worded here with the flags that change them. A
    pipeline's stage count is --pp's: only a layout's pipeline has a count to refuse
    (--replicate's one pipeline chooses its own)."""
    if "fxpipe.partition" not in sys.modules:  # no solver ran (a mistyped flag): as raised
        return str(exc)
    from fxpipe.cluster import NoLayoutFits
    from fxpipe.partition import (
        InfeasibleMemoryError,
        NoSolutionError,
        PipedreamTieError,
        TooManyStagesError,
    )
    from fxpipe.units import format_alternatives, format_bytes, format_bytes_up

    if isinstance(exc, TooManyStagesError):
        if exc.nodes == 0:  # no stage count helps: the solver's words say what does
            return str(exc)
        if exc.virtual_stages > 1:
            return (f"cannot cut {exc.most} nodes into {exc.stages} stage modules "
                    f"({exc.devices} GPUs x {exc.virtual_stages} virtual stages); use fewer "
                    f"--pp or --virtual-stages")
        if exc.nodes < exc.stages:
            return (f"cannot cut {exc.nodes} nodes into {exc.stages} stages; use "
                    f"--pp {exc.most} or fewer")
        return (f"cannot cut the model into {exc.stages} stages: its {exc.nodes} nodes form "
                f"only {exc.groups} groups that must share a stage; use --pp {exc.most} "
                f"or fewer")
    if isinstance(exc, PipedreamTieError):
        return (f"--schedule pipedream updates each stage's own weights after every "
                f"micro-batch, so the tied parameter {exc.name} keeps every op between its "
                f"readers on one stage, {exc.share:.0%} of the model's time, and {exc.stages} "
                "stages cannot balance; use --schedule 1f1b, or untie the parameter")
    if isinstance(exc, NoLayoutFits):
        inner = exc.error
        # a leaner precision on more GPUs: the layout it fits on
        on = None if exc.leaner_on is None else exc.flags(exc.leaner_on)
        fixes = _memory_fixes(inner, more_gpus=False, precision_on=on)
        if exc.fits_on is not None:  # more GPUs: the layout that fits on the fewest
            fixes.insert(0, exc.flags(exc.fits_on))
            where = f"; it fits on {exc.fits_on[0]} GPUs as {exc.fits_on[1]}"
        elif inner.alone is not None:  # what the bounds proved: no GPU count fits
            where = inner.proved()
        else:
            where = exc.none_larger()
        return f"{exc.head()}{where}; use {format_alternatives(fixes)}"
    if isinstance(exc, InfeasibleMemoryError):
        fixes = _memory_fixes(exc)
        return (f"no split of the model onto {exc.devices} GPUs fits in "
                f"{format_bytes(exc.limit)} per GPU; the best split needs "
                f"{format_bytes(exc.needed)}{exc.proved()}; use {format_alternatives(fixes)}")
    if isinstance(exc, NoSolutionError):
        where = (f"onto {exc.devices} GPUs" if exc.limit is None
                 else f"that fits in {format_bytes(exc.limit)} per GPU")
        if exc.too_big is not None:  # only the interval DP looked: more work is no fix
            found = f"by the interval DP (too big for CP-SAT: {exc.too_big:,} placements)"
            fix = "use more --gpus"
        elif exc.wall_clock:
            found, fix = f"in {exc.time_limit_s:g} s", "raise --time-limit"
        else:
            found, fix = f"within --work-limit {exc.work_limit:g}", "raise --work-limit"
        if exc.leanest is not None:  # a limit the leanest split found fits in
            return (f"no split {where} was found {found}; the leanest found needs "
                    f"{format_bytes(exc.leanest)}: {fix} or use --memory "
                    f"{format_bytes_up(exc.leanest)}")
        memory = "" if exc.limit is None else " or the memory limit"
        return f"no split {where} was found {found}; {fix}{memory}"
    return str(exc)


def _memory_fixes(exc: InfeasibleMemoryError, more_gpus: bool = True,
                  precision_on: str | None = None) -> list[str]:
    """What would fit, as flags, from a solver's ``InfeasibleMemoryError``; ``more_gpus``:
    "more --gpus" where nothing else is named (not where a layout on more is);
    ``precision_on``: the flags of the GPUs a leaner precision needs where it needs more
    (a layout's), else ``--gpus`` its count."""
    from fxpipe.units import format_bytes_up

    fixes = [f"--memory {format_bytes_up(exc.needed)}"]
    if exc.fits_on is not None:  # at the M it was found at: the default M follows --gpus
        at = "" if exc.microbatches is None else f" --microbatches {exc.microbatches}"
        fixes.append(f"--gpus {exc.fits_on}{at}")
    if exc.recompute is not None:
        fixes.append(f"--recompute {exc.recompute}")
    if exc.precision is not None:
        on = ("" if exc.precision_gpus is None
              else f" {precision_on or f'--gpus {exc.precision_gpus}'}")
        fixes.append(f"--precision {exc.precision}{on}")
    if exc.samples is not None:
        b, B, M = exc.samples
        fixes.append(f"an example of {b} samples (not {B}) with --microbatches {M}")
    if exc.schedule is not None:
        fixes.append(f"--schedule {exc.schedule}")
    if more_gpus and len(fixes) == 1 and exc.alone is None and exc.searched is None:
        fixes.append("more --gpus" if exc.at_least is None
                     else f"--gpus {exc.at_least} or more")
    return fixes


if __name__ == "__main__":
    run()
