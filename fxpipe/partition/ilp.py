"""The CP-SAT program: minimise the bottleneck stage time (docs/design.md, "The
partitioning problem").

Legend: g a coarse node (a group of fine nodes that share a stage, see coarsen.py),
j = 0..K-1 a stage, b = 0..K-2 the boundary between stage b and b + 1, k a value
class: the values produced in one group and read by the same set W of other groups
(they cross the same boundaries, so they share indicators and their costs add up).

Variables
    d[g,j]  = [stage(g) <= j]  (cumulative encoding; d[g,K-1] = 1 is a constant)
    x[g,j]  = d[g,j] - d[g,j-1]  = [stage(g) == j]  (an expression, not a variable)
    NEIGHBOUR transport:
      cu[k,b] = [the values go up across b]   >= d[g,b] - d[w,b] for w in W
      cd[k,b] = [they come down across b]     >= d[w,b] - d[g,b] for w in W read by
                                                 unordered edges (backward passes)
    DIRECT transport:
      r[k,j]  = [stage j receives them]       >= x[w,j] - x[g,j]
      o[k,j]  = [stage j sends them]          >= x[g,j] - x[w,j]
    either transport, when memory is limited or minimised:
      e[k,j]  = [stage j produces them and a later stage reads them] >= x[g,j] - d[w,j]
                for w in W (stage j keeps them until the backward: StageMemory.outputs)
      B[j]    = bytes of the largest backward transient on stage j >= grad[g] * x[g,j]
                (an integer, StageMemory.backward; grad[g]: the largest of g's nodes')
    tied parameter G (copied): u[G,j] = [stage j holds a copy], m[G] = [more than one
      copy], a[G,j] = [stage j all-reduces]
    recompute chosen per stage (Problem.recompute AUTO, where memory counts):
      z[j]    = [stage j recomputes in full: keeps one micro-batch's activations, runs its
                forward again in the backward]
      s{l}[j] = [stage j recomputes selectively at keep level l: keeps the matmuls' and
                attention's outputs the level's rule keeps per micro-batch, runs the rest of
                its forward again] (``Problem.keep_levels``; s[j] for level 0; not where
                the schedule splits the backward); z[j] + sum_l s{l}[j] <= 1
      A[j]    = bytes of its saved activations and loss >= those its choice keeps
                (``cost.saved_activations``)
      R[j]    = ticks of its forward run again >= those its choice runs again
      (under NONE, SELECTIVE or ALL, or with nothing to gain, the choice is a constant and
      A, R are terms)
    replicated stages (N GPUs > K stages): y[j,r] = [stage j runs on r GPUs], r = 1..N-K+1,
      one r per stage, sum_j sum_r r * y[j,r] = N; stage j's time and memory rows hold
      only where y[j,r] (CP-SAT enforcement literals), with compute and activations / r
      and the ring all-reduce of its parameters' gradients added
    T = the bottleneck: the slowest stage, or the slowest GPU (the sum of its stage
      modules) when interleaved or V-placed (ZB-V, DualPipeV: stage j and K - 1 - j on
      GPU j, ``Problem.device_of``, so the cuts of both chunks are chosen together)
    zero-bubble schedules: what the waiting weight gradients keep, deferred[g] bytes per
      micro-batch whose W waits on stage j at its peak (``stage_deferred``), is part of
      stage j's memory row: sum_g deferred[g] * waiting[j] * x[g,j]

Indicators (and B, A, R) only have lower bounds: the objective and the memory rows never gain
from raising one, so at an optimum they take their exact values, and the objective equals
``evaluate``'s bottleneck for the returned assignment and the memory rows equal the stage
cost formula (``fxpipe.partition.cost``) for any assignment (checked in tests/partition).

Integer scaling: CP-SAT works on integers. Seconds are multiplied by a power of ten,
``ticks_per_second``, chosen so that the whole graph's time is at most 1e9 ticks
(nanoseconds for a one-second step; see ``ilp_inputs.TARGET_TICKS`` for why not finer);
bytes are used as they are. A group's time and a value class's transfer time are each
rounded once, so a stage's time is off by at most half a tick per term; the reported
objective is re-evaluated in floating point by ``evaluate`` and the reported bound is
lowered by that rounding margin.

Where the pieces live: ``ilp_inputs`` the plain numbers (the tick scale, per coarse node,
per value class), ``ilp_terms`` rows as lists of terms and the indicators they define,
``ilp_rows`` each stage's time and memory rows (cu, cd, r, o, e, B, u, m, a),
``ilp_search`` running CP-SAT; here the program itself: d, the order, y, z, A, R, the
objective, the hints and the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ortools.sat.python import cp_model

from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.cost import Option, recompute_options
from fxpipe.partition.evaluate import evaluate
from fxpipe.partition.ilp_inputs import (
    group_costs,
    stage_ranges,
    ticks_per_second,
    value_classes,
)
from fxpipe.partition.ilp_rows import StageRows
from fxpipe.partition.ilp_search import run_search, stop_searches
from fxpipe.partition.ilp_terms import Term, TermBuilder, Terms, expr, total
from fxpipe.plan import StageRecompute

__all__ = ["IlpResult", "StageModel", "stop_searches", "ticks_per_second"]

@dataclass(frozen=True)
class IlpResult:
    status: str  # "OPTIMAL", "FEASIBLE", "INFEASIBLE", "UNKNOWN", "MODEL_INVALID"
    coarse_stage_of: tuple[int, ...] | None  # per coarse node; None when no solution
    stage_of: tuple[int, ...] | None  # per fine node
    objective: float  # seconds (time objective) or bytes (memory objective), as the model saw it
    bound: float  # proved lower bound in the same unit, lowered by the rounding margin
    wall_s: float
    num_nodes: int  # coarse nodes the model had
    replicas: tuple[int, ...] | None = None  # GPUs per stage when the model chose them
    recompute: tuple[Option, ...] | None = None  # per stage, as the model chose
    wall_clock_stopped: bool = False  # the wall-clock safety net, not the work limit, ended it

    @property
    def has_solution(self) -> bool:
        return self.stage_of is not None


class StageModel:
    """The CP-SAT model of one problem over one coarsening.

    ``hint``: a coarse assignment to start from; when it is valid and fits, the model also
    requires T <= its value and fixes the d[g,j] that this upper bound rules out.
    ``objective``: "time" (the bottleneck) or "memory" (the largest stage's bytes, with no
    memory limit: the smallest per-device memory any split needs).
    ``window``: per coarse node, the stages (first, last) it may take -- a restriction for
    a local re-solve around an incumbent, not a proof; solve without it to prove.
    ``upper_s``: only splits with a bottleneck below this are wanted (the best found so
    far); INFEASIBLE then means none is better.

    The variable and constraint families are added in the order ``__init__`` lists them:
    CP-SAT's search depends on that order, so changing it changes the splits found within
    a work limit.
    """

    def __init__(self, coarsening: Coarsening, *, objective: Literal["time", "memory"] = "time",
                 hint: Sequence[int] | None = None,
                 window: Sequence[tuple[int, int]] | None = None,
                 upper_s: float | None = None) -> None:
        self.coarsening = coarsening
        self.objective = objective
        p = self.problem = coarsening.problem
        K = self.num_stages = p.num_stages
        G = self.num_nodes = coarsening.num_coarse
        self.replicating = p.replicates
        assert not (self.replicating and objective == "memory"), "memory objective: one per GPU"
        # Index sets: stages j, boundaries b (between stage b and b + 1), coarse nodes g;
        # a pipeline position (a GPU, or a replicated stage's GPUs) runs the stage modules
        # on_device[position]: one each unless interleaved or V-placed.
        self.all_stages = range(K)
        self.boundaries = range(K - 1)
        self.all_nodes = range(G)
        self.on_device = [[j for j in self.all_stages if p.device_of(j) == position]
                          for position in range(K // p.virtual_stages)]

        self.scale = ticks_per_second(coarsening)
        costs = group_costs(coarsening, self.scale)
        classes = value_classes(coarsening)
        self.ticks = costs.ticks  # t[g]
        self.limited = p.memory_limit != float("inf")
        self.options = self._recompute_options()
        # Rounded coefficients in one row (a row: one GPU; interleaved, v stage modules).
        self._rounding_terms = (
            ((2 if self.replicating else 1) + (self.options != (Option(StageRecompute.NONE),)))
            * G
            + 4 * p.virtual_stages * len(classes) + len(costs.copied) + 1)
        self._hint_recompute: tuple[Option, ...] | None = None
        self.hint_ticks: int | None = None  # the hint's bound on T, where it is valid and fits
        self.upper_ticks = self._upper_ticks(hint, upper_s)

        self.model = cp_model.CpModel()
        self.terms = TermBuilder(self.model)
        self._add_positions(*self._stage_ranges(window))
        self._add_order()
        self.rows = StageRows(p, costs, classes, self.scale, self.terms, self.d,
                              memory_counts=self.limited or objective == "memory")
        self._add_replicas()
        self._add_recompute()
        self._build_rows()
        self._add_nonempty()
        if objective == "time":
            self._add_time_objective()
        else:
            self._add_memory_objective()
        if hint is not None:
            self._add_hints(hint)

    # -- bounds from the problem, before any variable ---------------------------------------

    def _recompute_options(self) -> tuple[Option, ...]:
        """The recompute choices the policy leaves, narrowed to those that can matter
        (without a memory limit recomputing only costs time; minimising memory, it only
        saves bytes). From the most bytes kept to the fewest."""
        options = recompute_options(self.problem)
        if self.objective == "memory":
            return options[-1:]
        if not self.limited:
            return options[:1]
        return options

    def _upper_ticks(self, hint: Sequence[int] | None, upper_s: float | None) -> int | None:
        """An upper bound on T in ticks, from a valid hint that fits and from ``upper_s``."""
        upper = (self._hint_upper_ticks(hint) if hint is not None and not self.replicating
                 and self._hint_is_valid(hint) and self.objective == "time" else None)
        if upper_s is not None and self.objective == "time":
            # strictly below the best so far, less the rounding margin of the scaled rows
            cap = math.floor(upper_s * self.scale - self._rounding_terms * 0.5)
            upper = cap if upper is None else min(upper, cap)
        return upper

    def _stage_ranges(self, window: Sequence[tuple[int, int]] | None,
                      ) -> tuple[list[int], list[int]]:
        """Per coarse node, the first and last stage it may take."""
        G, K = self.num_nodes, self.num_stages
        lo, hi = [0] * G, [K - 1] * G
        if self.upper_ticks is not None and self.upper_ticks > 0:
            # Stages 0..j run on at most j + 1 GPUs (j + 1 + N - K with replicas; the first
            # N stage modules when interleaved are on distinct GPUs), each at most UB.
            extra = self.problem.devices - K if self.replicating else 0
            lo, hi = stage_ranges(self.coarsening, self.ticks, self.upper_ticks, extra)
        if window is not None:
            lo = [max(a, w[0]) for a, w in zip(lo, window, strict=True)]
            hi = [min(b, w[1]) for b, w in zip(hi, window, strict=True)]
        return lo, hi

    # -- placement ---------------------------------------------------------------------------

    def _add_positions(self, lo: list[int], hi: list[int]) -> None:
        """d[g,j] = [stage(g) <= j]: a constant where g's stage range decides it."""
        self.d: list[list[Term]] = []
        for g in self.all_nodes:
            row: list[Term] = []
            for j in self.boundaries:
                if j < lo[g]:
                    row.append(0)
                elif j >= hi[g]:
                    row.append(1)
                else:
                    row.append(self.model.new_bool_var(f"d[{g},{j}]"))
            row.append(1)
            self.d.append(row)

    def _add_order(self) -> None:
        """Each node takes one stage, d[g,j] <= d[g,j+1], and stages never decrease along
        an ordering edge a -> b, d[b,j] <= d[a,j]."""
        for g in self.all_nodes:
            for j in range(self.num_stages - 2):
                self.terms.add_le([(1, self.d[g][j])], [(1, self.d[g][j + 1])])
        for a, b in self.coarsening.order_edges:
            for j in self.boundaries:
                self.terms.add_le([(1, self.d[b][j])], [(1, self.d[a][j])])

    # -- choices per stage -----------------------------------------------------------------

    def _add_replicas(self) -> None:
        """y[j,r]: stage j on r GPUs; every stage gets one r, and they add up to N."""
        self.y: list[dict[int, Term]] = []
        # per stage: replica count r -> y[j,r] (one GPU, always, when not replicating)
        self.replica_choice: list[dict[int, Term]] = [{1: 1} for _ in self.all_stages]
        if not self.replicating:
            return
        N, K = self.problem.devices, self.num_stages
        for j in self.all_stages:
            self.y.append({r: self.model.new_bool_var(f"y[{j},{r}]") for r in range(1, N - K + 2)})
            self.model.add_exactly_one(self.y[j].values())
        self.model.add(sum(r * y for row in self.y for r, y in row.items()) == N)
        self.replica_choice = self.y

    def _add_recompute(self) -> None:
        """z[j], s[j]: how stage j recomputes (nothing where the policy or the problem
        decides); A[j] >= its saved bytes and R[j] >= its forward run again, under each
        recompute choice and replica count where they hold."""
        self.z: list[list[Term]] = []  # per stage, per option after the first: [j takes it]
        self.kept: list[Terms] = []  # per stage: A[j], or nothing where the choice is decided
        self.again: list[Terms] = []  # per stage: R[j], or nothing where it is decided
        for j in self.all_stages:
            if len(self.options) == 1:
                self.z.append([])
                self.kept.append([])
                self.again.append([])
                continue
            picks: list[Term] = [self.model.new_bool_var(_literal(o, j)) for o in self.options[1:]]
            if len(picks) > 1:
                self.model.add_at_most_one(picks)
            self.z.append(picks)
            choices = self.replica_choice[j].items()
            taking = {o: _taking(self.options, picks, o) for o in self.options}
            kept_rows = [(self.rows.saved(j, r, o), [(y, True), *taking[o]])
                         for r, y in choices for o in self.options]
            again_rows = [(self.rows.run_again(j, r, o), [(y, True), *taking[o]])
                          for r, y in choices for o in self.options[1:]]
            self.kept.append([(1, self.terms.max_where(kept_rows, f"A[{j}]"))])
            self.again.append([(1, self.terms.max_where(again_rows, f"R[{j}]"))])

    # -- each GPU's time and memory rows ------------------------------------------------------

    def _recomputed(self, j: int, r: int) -> tuple[Terms, Terms]:
        """Stage j's (saved bytes, forward run again) on r replicas."""
        if not self.z[j]:
            option = self.options[0]
            return self.rows.saved(j, r, option), self.rows.run_again(j, r, option)
        return self.kept[j], self.again[j]

    def _stage_time(self, j: int, r: int) -> Terms:
        return self.rows.time(j, r) + self._recomputed(j, r)[1]

    def _stage_memory(self, j: int, r: int) -> Terms:
        return self.rows.memory(j, r) + self._recomputed(j, r)[0]

    def _build_rows(self) -> None:
        """Rows per GPU: a GPU's time and memory are the sums over its stage modules. With
        replicas, a time row and a memory row per (stage j, replica count r) instead, each
        enforced by y[j,r]."""
        self.time_terms: list[Terms] = []
        self.memory_terms: list[Terms] = []
        self.replica_rows: list[tuple[Term, Terms, Terms]] = []  # (y[j,r], time, memory)
        if self.replicating:
            self.replica_rows = [(y, self._stage_time(j, r), self._stage_memory(j, r))
                                 for j in self.all_stages for r, y in self.y[j].items()]
            return
        self.time_terms = [[tv for j in js for tv in self._stage_time(j, 1)]
                           for js in self.on_device]
        self.memory_terms = [[tv for j in js for tv in self._stage_memory(j, 1)]
                             for js in self.on_device]

    # -- constraints on the rows, and the objective --------------------------------------------

    def _add_nonempty(self) -> None:
        """Every stage holds a node, sum_g x[g,j] >= 1 (unless empty stages are allowed)."""
        if self.problem.allow_empty_stages:
            return
        for j in self.all_stages:
            holds: Terms = [tv for g in self.all_nodes for tv in self.rows.x(g, j)]
            self.model.add(expr(holds) >= 1)

    def _add_time_objective(self) -> None:
        """Minimise the bottleneck T: every GPU's time row is at most T and its memory row
        at most the limit (with replicas, the rows of each stage's chosen replica count)."""
        p, m, t = self.problem, self.model, self.ticks
        N, K = p.devices, self.num_stages
        lower = max(-(-sum(t) // N), -(-max(t, default=0) // (N - K + 1 if self.replicating
                                                               else 1)))
        rows = ([row for _, row, _ in self.replica_rows] if self.replicating
                else self.time_terms)
        upper = self.upper_ticks if self.upper_ticks is not None else max(
            1, sum(abs(c) for terms in rows for c, _ in terms))
        self.T = m.new_int_var(min(lower, upper), upper, "T")
        if self.replicating:
            for y, time_row, memory_row in self.replica_rows:
                m.add(expr(time_row) <= self.T).only_enforce_if(y)
                if self.limited:
                    m.add(expr(memory_row) <= int(p.memory_limit)).only_enforce_if(y)
        else:
            for gpu_time in self.time_terms:
                m.add(expr(gpu_time) <= self.T)
            if self.limited:
                for gpu_memory in self.memory_terms:
                    m.add(expr(gpu_memory) <= int(p.memory_limit))
        m.minimize(self.T)

    def _add_memory_objective(self) -> None:
        """Minimise the largest GPU's memory: every GPU's memory row is at most T."""
        upper = max(self.terms.range(gpu_memory)[1] for gpu_memory in self.memory_terms)
        self.T = self.model.new_int_var(0, max(0, upper), "memory")
        for gpu_memory in self.memory_terms:
            self.model.add(expr(gpu_memory) <= self.T)
        self.model.minimize(self.T)

    # -- hints and the rows at an assignment ---------------------------------------------------

    def _hint_is_valid(self, hint: Sequence[int]) -> bool:
        c = self.coarsening
        if len(hint) != c.num_coarse or not all(0 <= s < self.num_stages for s in hint):
            return False
        if any(hint[a] > hint[b] for a, b in c.order_edges):
            return False
        return self.problem.allow_empty_stages or len(set(hint)) == self.num_stages

    def _hint_upper_ticks(self, hint: Sequence[int]) -> int | None:
        """An upper bound in ticks on the hint's bottleneck as this model computes it (one
        GPU per stage): the stage cost formula's, through ``evaluate``, plus the rounding
        margin of the scaled rows; None if it does not fit. Keeps its recompute choice."""
        evaluation = evaluate(self.problem, self.coarsening.expand(hint))
        self._hint_recompute = evaluation.options
        if not evaluation.estimate.fits:
            return None
        self.hint_ticks = math.ceil(evaluation.bottleneck_s * self.scale + self._rounding_terms / 2)
        return self.hint_ticks

    def _values(self, assignment: Sequence[int], recompute: Sequence[Option],
                ) -> tuple[dict[int, int], dict[int, cp_model.IntVar]]:
        """Every variable's value (by index) at a coarse assignment and recompute choice:
        d from the assignment, z from the choice, the others at the least their rows allow."""
        values: dict[int, int] = {}
        variables: dict[int, cp_model.IntVar] = {}
        for g, row in enumerate(self.d):
            for j, var in enumerate(row):
                if not isinstance(var, int):
                    values[var.index] = int(assignment[g] <= j)
                    variables[var.index] = var
        for j, picks in enumerate(self.z):
            for option, z in zip(self.options[1:], picks, strict=True):
                assert isinstance(z, cp_model.IntVar)
                values[z.index] = int(recompute[j] == option)
                variables[z.index] = z
        self.terms.least_values(values, variables)
        return values, variables

    def rows_at(self, assignment: Sequence[int], recompute: Sequence[Option],
                ) -> tuple[list[int], list[int]]:
        """Each GPU's time row (ticks) and memory row (bytes) at a coarse assignment and
        recompute choice: the linear form of the stage cost formula, which tests hold
        against ``evaluate``. One GPU per stage (not replicated) only."""
        assert not self.replicating
        values, _ = self._values(assignment, recompute)
        return ([total(row, values) for row in self.time_terms],
                [total(row, values) for row in self.memory_terms])

    def _add_hints(self, hint: Sequence[int]) -> None:
        """Hint every variable: d from the assignment, z and s from ``evaluate``'s recompute
        choice for it, indicators from their definitions."""
        if self.replicating or not self._hint_is_valid(hint):
            return
        recompute = self._hint_recompute
        if recompute is None:
            recompute = evaluate(self.problem, self.coarsening.expand(hint)).options
        values, variables = self._values(hint, recompute)
        for index, hinted in values.items():
            self.model.add_hint(variables[index], hinted)
        rows = self.time_terms if self.objective == "time" else self.memory_terms
        top = max(total(row, values) for row in rows)
        domain = self.T.proto.domain
        if domain[0] <= top <= domain[-1]:
            self.model.add_hint(self.T, top)

    # -- solving -------------------------------------------------------------------------------

    def export_model(self, path: str) -> None:
        """Write the model (text proto if ``path`` ends in .txt / .pbtxt) for debugging."""
        self.model.export_to_file(path)

    def solve(self, *, work_limit: float = 10.0, time_limit_s: float = 30.0, workers: int = 2,
              log: bool = False) -> IlpResult:
        """Solve within ``work_limit`` units of CP-SAT's deterministic time (roughly seconds on
        a quiet machine), so that the answer is the same however loaded the machine is;
        ``time_limit_s`` of wall clock is a safety net, and ``IlpResult.wall_clock_stopped``
        says when it fired (the answer may then differ from run to run)."""
        search = run_search(self.model, work_limit=work_limit, time_limit_s=time_limit_s,
                            workers=workers, log=log)
        name = _status(search.status, self)
        if not search.found:
            return IlpResult(name, None, None, math.inf, 0.0, search.wall_s, self.num_nodes,
                             wall_clock_stopped=search.wall_clock_stopped)
        unit = self.scale if self.objective == "time" else 1
        margin = self._rounding_terms * 0.5 / unit if self.objective == "time" else 0.0
        coarse = tuple(
            sum(1 for v in row[:-1] if search.value(v) == 0) for row in self.d
        )
        objective = search.objective / unit
        bound = max(0.0, search.bound / unit - margin)
        replicas = tuple(next(r for r, y in row.items() if search.value(y)) for row in self.y)
        recompute = tuple(_choice(self.options, picks, search.value) for picks in self.z)
        return IlpResult(name, coarse, self.coarsening.expand(coarse), objective,
                         min(bound, objective), search.wall_s, self.num_nodes, replicas or None,
                         recompute, wall_clock_stopped=search.wall_clock_stopped)


def _status(name: str, model: StageModel) -> str:
    """CP-SAT's status of ``model``, but INFEASIBLE is UNKNOWN (no proof) where the hint
    solves the program, T bounded by the hint's own bottleneck: OR-Tools 9.15's presolve
    proved such a program INFEASIBLE (Llama-3-70B's exact groups at --gpus 64 --pp 8 --tp 8,
    one worker), and read as proof it made the hint "OPTIMAL" where a split 0.9 % faster
    existed."""
    hinted = model.hint_ticks
    if name == "INFEASIBLE" and hinted is not None and model.upper_ticks == hinted:
        return "UNKNOWN"
    return name


def _literal(option: Option, j: int) -> str:
    """The name of stage j's literal of ``option``: z[j] (full), s[j] or s{level}[j]."""
    letter = "z" if option.mode is StageRecompute.FULL else "s"
    return f"{letter}{option.level or ''}[{j}]"


def _taking(options: Sequence[Option], picks: Sequence[Term], option: Option
            ) -> list[tuple[Term, bool]]:
    """The literals (and values) that mean a stage takes ``option``: ``picks`` are its
    literals of the options after the first."""
    i = options.index(option)
    if i == 0:
        return [(z, False) for z in picks]
    return [(picks[i - 1], True)]


def _choice(options: Sequence[Option], picks: Sequence[Term],
            value: Callable[[Term], int]) -> Option:
    """A stage's recompute choice, its literals' values read by ``value``."""
    taken = [i + 1 for i, z in enumerate(picks) if value(z)]
    return options[taken[0] if taken else 0]
