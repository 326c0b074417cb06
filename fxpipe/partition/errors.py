"""What the solver cannot do, as data: each error carries the figures a caller needs to
advise the user (stages asked for and possible, bytes needed, the limit, the time limit).

The messages speak the solver's terms (stages, GPUs, bytes, seconds); the CLI words the
same figures with its flags (``--gpus``, ``--memory``, ``--time-limit``), so this layer
knows nothing of how it is driven. All are ``ValueError``: the user asked for a split that
cannot be had. Each crosses processes as it is (``Figures``: a split run in a
``multiprocessing`` pool raises the same error in the parent, not a pickling one).
"""

from __future__ import annotations

from typing import Any

from fxpipe.units import format_alternatives, format_bytes

__all__ = [
    "Figures",
    "InfeasibleMemoryError",
    "NoSolutionError",
    "PipedreamTieError",
    "ProblemTooLargeError",
    "TooManyStagesError",
]


class Figures(ValueError):
    """An error whose figures are its attributes and whose message is worded from them
    once: pickled as both, not by calling ``__init__`` again with the message (which
    takes the figures, not a message)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt, (type(self), self.args, self._figures())

    def _figures(self) -> dict[str, Any]:
        """The attributes that cross processes (all of them here)."""
        return dict(vars(self))


def _rebuilt(cls: type[Figures], args: tuple[Any, ...], figures: dict[str, Any]) -> Figures:
    error = cls.__new__(cls)
    ValueError.__init__(error, *args)
    vars(error).update(figures)
    return error


class TooManyStagesError(Figures):
    """More stages than nodes, or than groups of nodes that must share a stage.

    ``most`` is the largest stage count the graph allows: ``nodes`` when there are too
    few nodes, else ``groups``. ``virtual_stages`` > 1: the stages are interleaved stage
    modules, ``virtual_stages`` per GPU on ``devices`` GPUs.
    """

    def __init__(self, *, stages: int, nodes: int, groups: int, devices: int,
                 virtual_stages: int = 1) -> None:
        self.stages = stages
        self.nodes = nodes
        self.groups = groups
        self.devices = devices
        self.virtual_stages = virtual_stages
        self.most = min(nodes, groups)
        super().__init__(self._message())

    def _message(self) -> str:
        K, most = self.stages, self.most
        if self.nodes == 0:  # fewer stages would not help: there is nothing to cut
            return ("the model has no operations to cut into stages (forward returns its "
                    "inputs or constants); give it layers, or run it without a pipeline")
        if self.virtual_stages > 1:
            return (f"cannot cut {most} nodes into {K} stage modules ({self.devices} GPUs x "
                    f"{self.virtual_stages} virtual stages); use fewer GPUs or virtual stages")
        if self.nodes < K:
            return f"cannot cut {self.nodes} nodes into {K} stages; use {most} stages or fewer"
        return (f"cannot cut the model into {K} stages: its {self.nodes} nodes form only "
                f"{self.groups} groups that must share a stage; use {most} stages or fewer")


class PipedreamTieError(Figures):
    """Under PipeDream's weight stashing the tied parameter ``name`` keeps every op
    between its readers on one stage: ``share`` of the model's time, more than ``stages``
    balanced stages would give one of them."""

    def __init__(self, *, name: str, share: float, stages: int) -> None:
        self.name = name
        self.share = share
        self.stages = stages
        super().__init__(
            f"PipeDream updates each stage's own weights after every micro-batch, so the "
            f"tied parameter {name} keeps every op between its readers on one stage, "
            f"{share:.0%} of the model's time, and {stages} stages cannot balance; use "
            f"another schedule, or untie the parameter")


class ProblemTooLargeError(Figures):
    """More nodes (``nodes``) than the solver's memory allows (``most``): its program
    would need ``needs_bytes``, growing with the node count; or, where ``block`` is set,
    more nodes than ``most`` between two that no value skips, whose reachability matrix
    grows with the square of that count."""

    def __init__(self, *, nodes: int, most: int, needs_bytes: float, block: int = 0) -> None:
        self.nodes = nodes
        self.most = most
        self.needs_bytes = needs_bytes
        self.block = block
        if block:
            why = (f"the model has {block:,} ops between two that no value skips (one "
                   f"made early and read late: a skip over the model), more than the "
                   f"{most:,} the solver handles: its memory grows with the square of that "
                   f"count ({block:,} ops would need {format_bytes(needs_bytes)})")
        else:
            why = (f"the model has {nodes:,} ops, more than the {most:,} the solver handles: "
                   f"its memory grows with the op count ({nodes:,} ops would need "
                   f"{format_bytes(needs_bytes)})")
        super().__init__(f"{why}; plan a smaller model with the same blocks, e.g. fewer "
                         f"layers")


class InfeasibleMemoryError(Figures):
    """No split onto ``devices`` GPUs fits ``limit`` bytes per GPU; the leanest split found
    needs ``needed``.

    What would fit instead, each found by a split that does: ``fits_on`` GPUs (None when
    not searched or none found), ``recompute`` the recompute policy (None when it would
    not help or is already allowed), ``precision`` a leaner training precision (None when
    none was tried or none fits; the caller, which costs the graph, tries them:
    ``but``), on ``precision_gpus`` GPUs where it needs more than asked; ``samples`` =
    (b, B, M) micro-batches of b of the example's B samples, M of them per step (None
    when none was tried or none fits; the caller tries them too); ``schedule`` a schedule
    that keeps fewer micro-batches in flight. What is proved cannot fit: fewer than
    ``at_least`` GPUs (None when not known), and, with ``alone`` = (name, bytes), any
    number of GPUs, since that one group of ops needs more than the limit on a stage of
    its own. ``searched``: when ``fits_on`` is None, the most GPUs the search for it
    tried (None: every count there can be). ``microbatches``: the M that ``fits_on`` was
    found at, said with it, since the GPU count the command line is given also sets its
    default M (advice found at one M would not hold at another)."""

    def __init__(self, *, devices: int, limit: float, needed: float,
                 fits_on: int | None = None, recompute: str | None = None,
                 precision: str | None = None, at_least: int | None = None,
                 alone: tuple[str, float] | None = None,
                 precision_gpus: int | None = None, searched: int | None = None,
                 samples: tuple[int, int, int] | None = None,
                 schedule: str | None = None, microbatches: int | None = None) -> None:
        self.devices = devices
        self.limit = limit
        self.needed = needed
        self.fits_on = fits_on
        self.recompute = recompute
        self.precision = precision
        self.at_least = at_least
        self.alone = alone
        self.precision_gpus = precision_gpus
        self.searched = searched
        self.samples = samples
        self.schedule = schedule
        self.microbatches = microbatches
        fixes = [f"allow {format_bytes(needed)} per GPU"]
        if fits_on is not None:
            at = ("" if microbatches is None else
                  f" with M = {microbatches} micro-batch{'es' * (microbatches != 1)}")
            fixes.append(f"use {fits_on} GPUs{at}")
        if recompute is not None:
            fixes.append(f"recompute ({recompute})")
        if precision is not None:
            on = "" if precision_gpus is None else f" on {precision_gpus} GPUs"
            fixes.append(f"train at precision {precision}{on}")
        if samples is not None:
            b, B, M = samples
            fixes.append(f"train on micro-batches of {b} samples, not {B} ({M} per step)")
        if schedule is not None:
            fixes.append(f"use the {schedule} schedule")
        super().__init__(
            f"no split of the model onto {devices} GPUs fits in {format_bytes(limit)} per GPU; "
            f"the best split needs {format_bytes(needed)}{self.proved()}; to fit, "
            f"{format_alternatives(fixes)}")

    def proved(self) -> str:
        """What the bounds proved cannot fit, as a clause (empty when nothing is)."""
        if self.alone is not None:
            name, needs = self.alone
            return (f", and {name} alone needs {format_bytes(needs)}, so no number of "
                    "GPUs fits")
        if self.fits_on is not None:
            return ""
        fewer = ("" if self.at_least is None
                 else f"no split onto fewer than {self.at_least} GPUs can fit")
        if self.searched is None:
            return f", and {fewer}" if fewer else ""
        searched = f"none was found on up to {self.searched} GPUs"
        return f", {fewer}, and {searched}" if fewer else f", and {searched}"

    def but(self, **fixes: Any) -> InfeasibleMemoryError:
        """The same error naming more fixes (``precision``, ``precision_gpus``,
        ``samples``, ``schedule``), found by a caller that costs the graph again."""
        fields = ("devices", "limit", "needed", "fits_on", "recompute", "precision",
                  "at_least", "alone", "precision_gpus", "searched", "samples", "schedule",
                  "microbatches")
        return InfeasibleMemoryError(**{**{f: getattr(self, f) for f in fields}, **fixes})


class NoSolutionError(Figures):
    """The search ended before any split was found: its work limit (``work_limit``, CP-SAT
    deterministic time) ran out, or, when ``wall_clock`` is true, the wall-clock safety net
    (``time_limit_s``) did first. ``limit``: the per-GPU memory every split had to fit, or
    None when memory was not the obstacle (the replicated search, which tries every stage
    count). ``leanest``: the per-GPU memory of the leanest split found (``min_memory``),
    which fits for sure at that limit; None where it was not looked for. ``too_big``: the
    placement variables of a program too big for CP-SAT (``solve.HUGE_MODEL``), where only
    the interval DP looked: more work would not help there."""

    def __init__(self, *, devices: int, work_limit: float, time_limit_s: float,
                 wall_clock: bool, limit: float | None, leanest: float | None = None,
                 too_big: int | None = None) -> None:
        self.devices = devices
        self.work_limit = work_limit
        self.time_limit_s = time_limit_s
        self.wall_clock = wall_clock
        self.limit = limit
        self.leanest = leanest
        self.too_big = too_big
        where = (f"onto {devices} GPUs" if limit is None
                 else f"that fits in {format_bytes(limit)} per GPU")
        budget = (f"in {time_limit_s:g} s of wall clock" if wall_clock
                  else f"within a work limit of {work_limit:g}")
        more = "more time" if wall_clock else "more work"
        fix = f"allow the solver {more}" + ("" if limit is None else " or more memory")
        if too_big is not None and limit is not None:
            budget = (f"by the interval DP (a program of {too_big:,} placement variables is "
                      f"too big for CP-SAT)")
            fix = "allow more memory"
        if leanest is not None:
            fix += f" (the leanest split found needs {format_bytes(leanest)})"
        message = f"no split {where} was found {budget}; {fix}"
        super().__init__(message)
