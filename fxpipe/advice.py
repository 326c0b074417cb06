"""When no split fits: what would, found by costing the graph again.

``partition`` raises ``InfeasibleMemoryError`` with what the solver's problem alone can
tell (``partition/nothing_fits.py``: the leanest split's memory, the fewest GPUs,
recompute). What needs the graph itself is found here, each by costing the graph's bytes
once more and a fast split that fits for sure (``dp_fits``): a leaner precision
(``fitting_precision``), smaller micro-batches (``fitting_samples``), and 1F1B where
another schedule was asked for (``fits_in_1f1b``). ``advised`` adds them to the error;
``advised_layout`` to the layout search's, where a leaner precision that needs more GPUs
is said as the layout it fits on, searched as the job runs.

The driver lowers (``problem``: the solver's problem the options make of the graph, as
it is annotated at the time of the call), so each fix is a problem lowered as a split of
those options would be.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.forked import Forked
from fxpipe.frontend import Traced
from fxpipe.options import SplitOptions, execution
from fxpipe.partition import InfeasibleMemoryError, Problem, dp_fits, fewest_gpus
from fxpipe.passes import annotate_memory, annotate_modules
from fxpipe.passes.base import AnalysisError
from fxpipe.precision import Precision, default_precision
from fxpipe.schedules import ScheduleKind

if TYPE_CHECKING:
    from fxpipe.cluster import FitsOn, NoLayoutFits

__all__ = ["MAX_HALVINGS", "advised", "advised_layout", "fits_in_1f1b", "fitting_precision",
           "fitting_samples"]

# the solver's problem ``options`` make of the graph as it is annotated now
Lowering = Callable[[SplitOptions], Problem]
# the fewest GPUs a split fits on at a leaner precision, counted the caller's way
OnMore = Callable[[Precision], int | None]

# The precisions that may need less memory than each, in the order they are suggested:
# bf16-mixed first, the way LLMs usually train (float32 master weights); bf16-true halves
# the parameters and optimizer state too, but the model must be cast. Whether one fits is
# found by costing the graph at it, never assumed (autocast's weight copies can make
# bf16-mixed need more than 32-true on a model of big weights and small activations).
_LEANER = {
    Precision.TRUE_64: (Precision.BF16_MIXED, Precision.BF16_TRUE),
    Precision.TRUE_32: (Precision.BF16_MIXED, Precision.BF16_TRUE),
    Precision.BF16_MIXED: (Precision.BF16_TRUE,),
    Precision.MIXED_16: (Precision.TRUE_16,),
}

# Micro-batch sizes tried when nothing fits: the example's batch halved up to this often
# (each costs the graph's bytes once more).
MAX_HALVINGS = 6


def advised(error: InfeasibleMemoryError, traced: Traced, options: SplitOptions, *,
            problem: Lowering, on_more: OnMore | None = None) -> InfeasibleMemoryError:
    """``error`` with the fixes that fit named (a leaner precision, and the GPUs it needs
    where it needs more, counted by ``on_more``, else as one pipeline's stages; smaller
    micro-batches; 1F1B), or ``error`` itself where none does."""
    fixes: dict[str, object] = {}
    leaner = fitting_precision(traced, options, error.fits_on, problem=problem,
                               on_more=on_more)
    if leaner is not None:
        fixes.update(precision=leaner[0].value, precision_gpus=leaner[1])
    samples = fitting_samples(traced, options, problem=problem)
    if samples is not None:
        fixes.update(samples=samples)
    if fits_in_1f1b(options, problem=problem):
        fixes.update(schedule=ScheduleKind.ONE_F_ONE_B.value)
    return error.but(**fixes) if fixes else error


def advised_layout(error: NoLayoutFits, traced: Traced, *, problem: Lowering) -> NoLayoutFits:
    """``error`` with what fits its leanest layout named (``advised``); a leaner precision
    that fits that layout's pipeline only on more GPUs is named with the layout it fits
    on, the fewest GPUs in whole hosts with the --pp and --dp-mode asked (``error.fewest``,
    the graph's bytes costed at that precision), or not at all where none does."""
    found: dict[Precision, FitsOn] = {}

    def on_more(precision: Precision) -> int | None:
        with _costed(traced, replace(error.options, precision=precision),
                     traced.flat_inputs) as ran:
            layout = error.fewest(precision)[0] if ran and error.fewest else None
        if layout is None:
            return None
        found[precision] = layout
        return layout[0]

    raw = advised(error.raw, traced, error.options, problem=problem, on_more=on_more)
    leaner_on = None if raw.precision is None else found.get(Precision(raw.precision))
    return error.but(raw, leaner_on)


def fitting_precision(traced: Traced, options: SplitOptions, fits_on: int | None, *,
                      problem: Lowering, on_more: OnMore | None = None
                      ) -> tuple[Precision, int | None] | None:
    """The first leaner precision (``_LEANER``) at which a split of the model fits with the
    other options as given, and None; else the one that fits on the fewest GPUs, fewer
    than ``fits_on`` (the fewest at the current precision; None: none), and that count:
    ``on_more``'s, else one pipeline's fewest stages (``fewest_gpus``). Found by costing
    the graph's bytes at it (``_bytes_again``) and a fast fitting split (``dp_fits``); the
    GPU counts are searched only when no precision fits as given. A precision the passes
    cannot run the graph at is not named (it could not be planned either).

    On a graph torch.export captured, the bytes at a ``*-true`` precision are those of the
    traced casts (a float32 trace keeps RMSNorm's ``to(float32)`` where the cast model
    runs ``to(bfloat16)``): more than the cast model keeps, so a fit found here holds when
    the model is planned at that precision, which traces it cast."""
    current = options.precision or default_precision(traced.gm)
    candidates = _LEANER.get(current, ())
    costed: list[tuple[Precision, Problem]] = []
    with ExitStack() as children:
        # Seconds each on a large model: all but the first in forked children meanwhile
        later = {candidate: children.enter_context(Forked(functools.partial(
            _fit_at, traced, options, candidate, problem))) for candidate in candidates[1:]}
        for candidate in candidates:
            job = later.get(candidate)
            at, fits = job.result() if job else _fit_at(traced, options, candidate, problem)
            if at is None:
                continue
            if fits:
                return candidate, None
            costed.append((candidate, at))
    leanest: tuple[Precision, int | None] | None = None
    for candidate, at in costed:
        gpus = on_more(candidate) if on_more is not None else fewest_gpus(at)
        fewest = leanest[1] if leanest is not None else fits_on
        if gpus is not None and (fewest is None or gpus < fewest):
            leanest = candidate, gpus
    return leanest


def _fit_at(traced: Traced, options: SplitOptions, precision: Precision, problem: Lowering
            ) -> tuple[Problem | None, bool]:
    """The problem of the graph's bytes at ``precision`` (``_bytes_again``; None where the
    passes cannot run it), and whether a fast split of it fits (``dp_fits``)."""
    at = _bytes_again(traced, replace(options, precision=precision), traced.flat_inputs,
                      problem)
    return at, at is not None and dp_fits(at)


def fitting_samples(traced: Traced, options: SplitOptions, *, problem: Lowering
                    ) -> tuple[int, int, int] | None:
    """Smaller micro-batches that fit with the other options as given: (b, B, M), micro-
    batches of b of the example's B samples, M of them per step (as many samples as
    before); the largest b of B / 2, B / 4, ... that fits, found as
    ``fitting_precision`` finds a precision (the graph's bytes costed again at that
    size, ``_bytes_again``, and a fast fitting split). None where none of them fits,
    where the example holds one sample, or where the graph does not take another batch
    size."""
    flat = traced.flat_inputs
    batched = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.dim() > 0
               and (not traced.batched or traced.batched[i])]
    free = {shape.name: shape.dynamic[0] for shape in traced.inputs if shape.dynamic}
    placeholders = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
    sizes = {flat[i].shape[0] for i in batched}
    if len(sizes) != 1 or any(free.get(placeholders[i]) is None for i in batched):
        return None
    (B,) = sizes
    b = B
    for _ in range(MAX_HALVINGS):
        if b % 2:
            return None
        b //= 2
        inputs = tuple(x.narrow(0, 0, b) if i in batched else x for i, x in enumerate(flat))
        step = replace(options, microbatches=options.microbatches * B // b)
        at = _bytes_again(traced, step, inputs, problem)
        if at is None:
            return None
        if dp_fits(at):
            return b, B, step.microbatches
    return None


def _bytes_again(traced: Traced, options: SplitOptions, inputs: tuple[Any, ...],
                 problem: Lowering) -> Problem | None:
    """The problem ``options`` make of the graph with its shapes and bytes costed once
    more (``_costed``); None where the passes cannot run it."""
    with _costed(traced, options, inputs) as ran:
        return problem(options) if ran else None


@contextmanager
def _costed(traced: Traced, options: SplitOptions, inputs: tuple[Any, ...]
            ) -> Iterator[bool]:
    """While open, the graph's shapes and bytes are costed once more, on ``inputs`` at the
    options' precision (one run of the graph; FLOPs and times, which do not decide a fit,
    are left as they are: the FLOP pass is the slowest); yields whether the passes could
    run it. The graph's own annotations are restored after."""
    gm = traced.gm
    at = execution(options.device, options.precision or default_precision(gm))
    saved = {node: dict(node.meta) for node in gm.graph.nodes}
    try:
        try:
            annotate_memory(gm, *inputs, execution=at, shapes=True)
            annotate_modules(gm)
        except AnalysisError:
            yield False
        else:
            yield True
    finally:
        for node, meta in saved.items():
            node.meta = meta


def fits_in_1f1b(options: SplitOptions, *, problem: Lowering) -> bool:
    """Whether a split fits under 1F1B, which keeps the fewest micro-batches in flight
    of the schedules (no weight stash, no deferred weight gradient), where another
    schedule was asked for; found by a fast fitting split."""
    if options.schedule is ScheduleKind.ONE_F_ONE_B:
        return False
    plain = replace(options, schedule=ScheduleKind.ONE_F_ONE_B, virtual_stages=1)
    return dp_fits(problem(plain))
