"""How a stage recomputes, in words: the modes a plan names per stage and runner.py's
``RECOMPUTE`` carries, and the keep rule of a selective one as a typed value that prints
as its mode. Plain Python (no torch): the plan writes a mode with it, the runtime reads
one back with it (``recompute.py`` runs them).

A stage recomputes in one of three ways (``MODES``): ``"none"`` keeps what its backward
needs for every micro-batch in flight; ``"full"`` keeps only what it receives and runs its
whole forward again in the backward; ``"selective"`` also keeps the outputs of its matrix
multiplications and fused attention (``recompute.SELECTIVE_KEEPS``) and runs only the
other ops again. A selective stage keeps by a ``KeepRule``, which its mode spells out:

    "selective"                  every such output (``KEEP_ALL``)
    "selective:W:N"              ``KeepRule(W, N)``: those doing more than W FLOPs per
                                 element, and of those doing W, the ones at most N wide
    "selective:W:N:W1xN1,..."    and never those of a (W1, N1), ... (``KeepRule.skip``)

``str(rule)`` writes a mode and ``keep_rule`` reads it: ``keep_rule(str(r)) == r``.
"""

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["KEEP_ALL", "MODES", "KeepRule", "keep_rule", "mode_name", "modes"]

MODES = ("none", "selective", "full")  # how a stage recomputes (see the module docstring)


class KeepRule(NamedTuple):
    """Which outputs of ``recompute.SELECTIVE_KEEPS`` a selective stage keeps: those of
    calls doing more than ``work`` FLOPs per element (``recompute.work_and_width``), and of
    those doing exactly ``work``, the ones at most ``width`` columns wide; never those of a
    (work, width) in ``skip`` (the model writes into them in place). ``KEEP_ALL`` keeps
    every one. Printed, the mode that keeps by it (``"selective:W:N"``)."""

    work: int
    width: int
    skip: tuple[tuple[int, int], ...] = ()

    def keeps(self, work: int, width: int) -> bool:
        if (work, width) in self.skip:
            return False
        return work > self.work or (work == self.work and width <= self.width)

    def __str__(self) -> str:
        if self == (0, 0, ()):  # KEEP_ALL
            return "selective"
        skip = ",".join(f"{w}x{n}" for w, n in self.skip)
        return f"selective:{self.work}:{self.width}" + (f":{skip}" if skip else "")


KEEP_ALL = KeepRule(0, 0)


def keep_rule(mode: str) -> KeepRule | None:
    """The rule of a selective mode (the one reader of ``str(KeepRule)``): ``"selective"``
    keeps all (``KEEP_ALL``), ``"selective:W:N"`` by ``KeepRule(W, N)``,
    ``"selective:W:N:W1xN1,W2xN2"`` also skipping those; None for another mode. ValueError
    where the numbers are not whole numbers, or there are not two of them (and the pairs)."""
    name, *parts = mode.split(":")
    if name != "selective":
        return None
    if not parts:
        return KEEP_ALL
    skip = [pair.split("x") for pair in parts[2].split(",")] if len(parts) == 3 else []
    numbers = [*parts[:2], *(n for pair in skip for n in pair)]
    if (len(parts) not in (2, 3) or any(len(pair) != 2 for pair in skip)
            or not all(n.isdigit() for n in numbers)):
        raise ValueError(f"{mode!r} is not selective:W:N[:W1xN1,...] (whole numbers)")
    return KeepRule(int(parts[0]), int(parts[1]), tuple((int(w), int(n)) for w, n in skip))


def mode_name(mode: str) -> str:
    """The ``MODES`` entry a stage's mode is (``"selective:W:N"`` is ``"selective"``)."""
    return mode.split(":")[0]


def modes(recompute: Sequence[str | bool] | None, num_stages: int) -> tuple[str, ...]:
    """Each stage's recompute mode from one entry per stage: one of ``MODES``,
    ``"selective:W:N"`` (keeping by ``KeepRule(W, N)``), or a bool (True: ``"full"``, as
    plans before selective recompute said it)."""
    if recompute is None:
        return ("none",) * num_stages
    if len(recompute) != num_stages:
        raise ValueError(f"recompute has {len(recompute)} entries for {num_stages} stages: "
                         f"pass one per stage ({', '.join(MODES)})")
    out = []
    for mode in recompute:
        if isinstance(mode, bool):
            mode = "full" if mode else "none"
        if not _valid(str(mode)):
            raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(MODES)} "
                             f"or selective:W:N[:W1xN1,...] (whole numbers)")
        out.append(str(mode))
    return tuple(out)


def _valid(mode: str) -> bool:
    """One of ``MODES``, or a selective mode with a rule ``keep_rule`` reads."""
    if ":" not in mode:
        return mode in MODES
    try:
        return keep_rule(mode) is not None
    except ValueError:
        return False
