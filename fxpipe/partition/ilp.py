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
    tied parameter G (replicated): u[G,j] = [stage j holds a copy], m[G] = [more than one
      copy], a[G,j] = [stage j all-reduces]
    recompute chosen per stage (Problem.recompute AUTO, where memory counts):
      z[j]    = [stage j recomputes: keeps one micro-batch's activations, runs its
                forward again in the backward]
      A[j]    = bytes of its saved activations and loss >= those kept for its micro-batches
                in flight (where not z[j]) or for one (where z[j])
      R[j]    = ticks of its forward run again >= its forward (where z[j])
      (under NONE or ALL, or with nothing to gain, z[j] is a constant and A, R are terms)
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
(nanoseconds for a one-second step; see TARGET_TICKS for why not finer); bytes are
used as they are. A group's time and a value class's transfer time are each rounded
once, so a stage's time is off by at most half a tick per term; the reported
objective is re-evaluated in floating point by ``evaluate`` and the reported bound is
lowered by that rounding margin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ortools.sat.python import cp_model

from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.cost import recompute_options
from fxpipe.partition.evaluate import evaluate
from fxpipe.partition.ilp_inputs import group_costs, stage_ranges, value_classes
from fxpipe.partition.ilp_search import run_search, stop_searches
from fxpipe.partition.ilp_terms import Term, TermBuilder, Terms, expr, total, value
from fxpipe.partition.problem import (
    Comm,
    Recompute,
    allreduce_s,
    allreduce_terms,
    stage_deferred,
    stage_flights,
)

__all__ = ["IlpResult", "StageModel", "stop_searches", "ticks_per_second"]

# At most ~1e9 ticks in all, so a coefficient squared stays below 2^63: with coefficients
# of ~1e11 CP-SAT 9.15's presolve (probing, inclusion) proved a 15 ms split "OPTIMAL"
# where a 14 ms one fits, and proved a feasible replicated model INFEASIBLE; both
# solve right at 1e9 (tests/partition/test_bruteforce.py keeps those cases).
TARGET_TICKS = 1e9

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
    recompute: tuple[bool, ...] | None = None  # per stage, as the model chose (z[j])
    wall_clock_stopped: bool = False  # the wall-clock safety net, not the work limit, ended it

    @property
    def has_solution(self) -> bool:
        return self.stage_of is not None


def ticks_per_second(coarsening: Coarsening) -> int:
    """A power of ten that makes the graph's total time at most TARGET_TICKS ticks."""
    p = coarsening.problem
    again = p.recompute is not Recompute.NONE  # a recomputed forward runs twice
    total = sum(n.forward_s * (2 if again else 1) + n.backward_s + 4 * n.comm_s
                for n in p.nodes)
    total += sum(t.allreduce_s for t in p.tied) * p.num_stages
    if p.replicates:  # the largest all-reduce a replicated stage could pay
        total += allreduce_s(p, sum(n.param_bytes for n in p.nodes), p.devices)
    if total <= 0:
        return 10**9
    return 10 ** min(15, max(0, math.floor(math.log10(TARGET_TICKS / total))))


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
        self.scale = ticks_per_second(coarsening)
        self.model = cp_model.CpModel()
        self.terms = TermBuilder(self.model)
        self._hint_recompute: tuple[bool, ...] | None = None
        all_stages = range(K)
        boundaries = range(K - 1)
        flight = list(stage_flights(p))
        waiting = list(stage_deferred(p))
        N = p.devices
        self.replicating = p.replicates
        assert not (self.replicating and objective == "memory"), "memory objective: one per GPU"
        stash = p.schedule.spec.stashes_weights  # a weight copy per micro-batch in flight
        # Pipeline position d (a GPU, or a replicated stage's GPUs) runs the stage modules
        # on_device[d]: one each unless interleaved.
        on_device = [[j for j in all_stages if p.device_of(j) == d]
                     for d in range(K // p.virtual_stages)]

        # Per coarse node: compute ticks, parameter-state bytes, activation bytes; per value
        # class (values produced in group g and read by groups W, unordered: Wu) its transfer
        # time, its bytes and the bytes of those not returned.
        costs = group_costs(coarsening, self.scale)
        secs, fwd, params, held = costs.secs, costs.fwd, costs.params, costs.held
        act, returned, grad, deferred = costs.act, costs.returned, costs.grad, costs.deferred
        replicated, state = costs.replicated, costs.state
        t, mem = costs.ticks, costs.state_bytes
        classes = value_classes(coarsening)
        # Recompute: the choices the policy leaves, narrowed to those that can matter
        # (without a memory limit recomputing only costs time; minimising memory, it only
        # saves bytes).
        limited = p.memory_limit != float("inf")
        options = recompute_options(p)
        if objective == "memory":
            options = (max(options),)
        elif not limited:
            options = (min(options),)
        # Rounded coefficients in one row (a row: one GPU; interleaved, v stage modules).
        self._rounding_terms = ((2 if self.replicating else 1) + (1 if True in options else 0)
                                ) * G + 4 * p.virtual_stages * len(classes) + len(replicated) + 1

        # Stage ranges from the upper bound: a node whose ancestors cost more than
        # (j+1)*UB cannot sit on stages <= j; one whose descendants cost more than
        # (K-j)*UB cannot sit on stages >= j.
        lo, hi = [0] * G, [K - 1] * G
        self.upper_ticks: int | None = None
        hint_valid = hint is not None and not self.replicating and self._hint_is_valid(hint)
        if hint is not None and hint_valid and objective == "time":
            self.upper_ticks = self._hint_upper_ticks(hint)
        if upper_s is not None and objective == "time":
            # strictly below the best so far, less the rounding margin of the scaled rows
            cap = math.floor(upper_s * self.scale - self._rounding_terms * 0.5)
            self.upper_ticks = cap if self.upper_ticks is None else min(self.upper_ticks, cap)
        if self.upper_ticks is not None and self.upper_ticks > 0:
            # Stages 0..j run on at most j + 1 GPUs (j + 1 + N - K with replicas; the first
            # N stage modules when interleaved are on distinct GPUs), each at most UB.
            ub = self.upper_ticks
            extra = N - K if self.replicating else 0
            lo, hi = stage_ranges(coarsening, t, ub, extra)

        if window is not None:
            lo = [max(a, w[0]) for a, w in zip(lo, window, strict=True)]
            hi = [min(b, w[1]) for b, w in zip(hi, window, strict=True)]
        # d[g,j] = [stage(g) <= j]; constants where the range decides it.
        m = self.model
        self.d: list[list[Term]] = []
        for g in range(G):
            row: list[Term] = []
            for j in boundaries:
                if j < lo[g]:
                    row.append(0)
                elif j >= hi[g]:
                    row.append(1)
                else:
                    row.append(m.new_bool_var(f"d[{g},{j}]"))
            row.append(1)
            self.d.append(row)

        # Stages never decrease along a node's own cumulative indicator.
        for g in range(G):
            for j in range(K - 2):
                self.terms.add_le([(1, self.d[g][j])], [(1, self.d[g][j + 1])])
        # Stages never decrease along an ordering edge u -> w: d[w,j] <= d[u,j].
        for a, b in coarsening.order_edges:
            for j in boundaries:
                self.terms.add_le([(1, self.d[b][j])], [(1, self.d[a][j])])

        # time_terms: communication and tied all-reduces; compute is added per replica count
        time_terms: list[Terms] = [[] for _ in all_stages]
        recv_terms: list[Terms] = [[] for _ in all_stages]

        # Communication, per value class k = (g, W, Wu) with transfer ticks c and bytes s.
        for k in classes:
            g, W, Wu = k.producer, k.readers, k.unordered
            c, s = round(k.comm_s * self.scale), round(k.out_bytes)
            if p.comm is Comm.NEIGHBOUR:
                cu = [self.terms.at_least([[(1, self.d[g][b]), (-1, self.d[w][b])] for w in W],
                                     f"cu[{g},{b}]") for b in boundaries]
                cd = [self.terms.at_least([[(1, self.d[w][b]), (-1, self.d[g][b])] for w in Wu],
                                     f"cd[{g},{b}]") for b in boundaries]
                for b in boundaries:
                    # a crossing of boundary b costs its sender and its receiver
                    for j in (b, b + 1):
                        time_terms[j] += [(c, cu[b]), (c, cd[b])]
                    recv_terms[b + 1].append((s, cu[b]))
                    recv_terms[b].append((s, cd[b]))
            else:
                for j in all_stages:
                    xg = self._x(g, j)
                    r = self.terms.at_least(
                        [self._x(w, j) + [(-c_, v_) for c_, v_ in xg] for w in W], f"r[{g},{j}]")
                    o = self.terms.at_least(
                        [xg + [(-c_, v_) for c_, v_ in self._x(w, j)] for w in W], f"o[{g},{j}]")
                    time_terms[j] += [(c, r), (c, o)]
                    recv_terms[j].append((s, r))

        # Values a stage keeps for a later stage until their backward (only where memory
        # counts): (bytes, e[k,j]) per stage j; its producer g on j and a reader w after j.
        sent_terms: list[Terms] = [[] for _ in all_stages]
        if limited or objective == "memory":
            for k in classes:
                g, W, sent_bytes = k.producer, k.readers, k.sent_bytes
                if not sent_bytes:
                    continue
                for j in boundaries:
                    kept = self.terms.at_least(
                        [[*self._x(g, j), (-1, self.d[w][j])] for w in W], f"e[{g},{j}]")
                    sent_terms[j].append((round(sent_bytes), kept))
        # The largest backward transient on each stage (only where memory counts).
        peak: list[Term] = [0] * K
        if limited or objective == "memory":
            peak = [self.terms.max_of([[(grad[g] * c, v) for c, v in self._x(g, j)]
                                  for g in range(G) if grad[g]], f"B[{j}]")
                    for j in all_stages]

        # Replicated tied parameters: a copy (memory) on every holder, an all-reduce on
        # each holder when there is more than one.
        tied_mem: list[Terms] = [[] for _ in all_stages]
        for tied, holders in replicated:
            name = tied.name
            uses = [self.terms.at_least([self._x(h, j) for h in holders], f"u[{name},{j}]")
                    for j in all_stages]
            first = holders[0]
            multi = self.terms.at_least(
                [[(1, uses[j])] + [(-c_, v_) for c_, v_ in self._x(first, j)] for j in all_stages],
                f"m[{name}]")
            ticks = round(tied.allreduce_s * self.scale)
            size = round(tied.param_bytes * state)
            for j in all_stages:
                allreduce = self.terms.at_least([[(1, uses[j]), (1, multi), (-1, 1)]],
                                           f"a[{name},{j}]")
                time_terms[j].append((ticks, allreduce))
                copies = tied.param_bytes * flight[j] if stash else 0
                tied_mem[j].append((size + copies, uses[j]))

        def compute(j: int, r: int) -> Terms:
            """Stage j's compute on r replicas, plus their all-reduce (r > 1)."""
            if r == 1:
                return [(t[g] * c, v) for g in range(G) for c, v in self._x(g, j)]
            per_byte, fixed = allreduce_terms(p, r)
            ticks = [round(secs[g] / r * self.scale) + round(params[g] * per_byte * self.scale)
                     for g in range(G)]
            return [(ticks[g] * c, v) for g in range(G) for c, v in self._x(g, j)] + [
                (round(fixed * self.scale), 1)]

        def saved(j: int, r: int, recompute: bool) -> Terms:
            """Stage j's saved activations and loss on each of r replicas: for its
            micro-batches in flight, or for one when it recomputes."""
            keep = 1 if recompute else flight[j]
            return [(-(-act[g] * keep // r) * c, v) for g in range(G) if act[g]
                    for c, v in self._x(g, j)] + [(-(-self._loss_bytes(j, keep) // r), 1)]

        def again(j: int, r: int) -> Terms:
            """Stage j's forward, run again in its backward when it recomputes."""
            ticks = [round(fwd[g] / r * self.scale) for g in range(G)]
            return [(ticks[g] * c, v) for g in range(G) if ticks[g] for c, v in self._x(g, j)]

        def memory(j: int, r: int) -> Terms:
            """Stage j's bytes on each of r replicas but its saved activations and loss
            (received, outputs / r; the backward transient whole)."""
            outs = flight[j] + 1  # kept per micro-batch in flight, + one of their gradients
            per_group = [((mem[g] + held[g] * flight[j] * stash
                           + -(-returned[g] * outs // r) + -(-deferred[g] * waiting[j] // r)) * c,
                           v)
                         for g in range(G) for c, v in self._x(g, j)]
            received = [(-(-s * flight[j] // r), v) for s, v in recv_terms[j]]
            sent = [(-(-s * outs // r), v) for s, v in sent_terms[j]]
            return (per_group + received + sent + tied_mem[j]
                    + [(1, peak[j]), (p.workspace_bytes, 1)])

        # Rows per GPU: a GPU's time and memory are the sums over its stage modules. With
        # replicas, a time row and a memory row per (stage j, replica count r) instead,
        # each enforced by y[j,r].
        self.time_terms: list[Terms] = []
        self.memory_terms: list[Terms] = []
        self.y: list[dict[int, Term]] = []
        sharing: list[dict[int, Term]] = [{1: 1} for _ in all_stages]  # r -> y[j,r]
        if self.replicating:
            # y[j,r]: stage j on r GPUs; every stage gets one r, and they add up to N.
            for j in all_stages:
                self.y.append({r: m.new_bool_var(f"y[{j},{r}]") for r in range(1, N - K + 2)})
                m.add_exactly_one(self.y[j].values())
            m.add(sum(r * y for row in self.y for r, y in row.items()) == N)
            sharing = self.y

        # z[j]: stage j recomputes (a constant where the policy or the problem decides);
        # A[j] its saved bytes and R[j] its forward run again, each at least what the
        # choice (and its replica count) implies.
        self.z: list[Term] = [m.new_bool_var(f"z[{j}]") if len(options) > 1
                              else int(options[0]) for j in all_stages]
        kept_terms: list[Terms] = []  # per stage: saved activations and loss, bytes
        again_terms: list[Terms] = []  # per stage: the forward run again, ticks
        for j in all_stages:
            z = self.z[j]
            if isinstance(z, int):  # decided: the terms themselves, per replica count
                kept_terms.append([])
                again_terms.append([])
                continue
            kept_rows = [(saved(j, r, choice), [(y, True), (z, choice)])
                         for r, y in sharing[j].items() for choice in (False, True)]
            again_rows = [(again(j, r), [(y, True), (z, True)]) for r, y in sharing[j].items()]
            kept_terms.append([(1, self.terms.max_where(kept_rows, f"A[{j}]"))])
            again_terms.append([(1, self.terms.max_where(again_rows, f"R[{j}]"))])

        def recomputed(j: int, r: int) -> tuple[Terms, Terms]:
            """Stage j's (saved bytes, forward run again) on r replicas."""
            z = self.z[j]
            if isinstance(z, int):
                return saved(j, r, bool(z)), again(j, r) if z else []
            return kept_terms[j], again_terms[j]

        def stage_time(j: int, r: int) -> Terms:
            return compute(j, r) + time_terms[j] + recomputed(j, r)[1]

        def stage_memory(j: int, r: int) -> Terms:
            return memory(j, r) + recomputed(j, r)[0]

        if self.replicating:
            enforced = [(y, stage_time(j, r), stage_memory(j, r))
                        for j in all_stages for r, y in self.y[j].items()]
        else:
            self.time_terms = [[tv for j in js for tv in stage_time(j, 1)] for js in on_device]
            self.memory_terms = [[tv for j in js for tv in stage_memory(j, 1)]
                                 for js in on_device]

        # Every stage holds a node (unless empty stages are allowed).
        if not p.allow_empty_stages:
            for j in all_stages:
                holds: Terms = [tv for g in range(G) for tv in self._x(g, j)]
                m.add(expr(holds) >= 1)

        if objective == "time":
            # Each GPU fits in memory; the bottleneck T bounds every GPU's time.
            lower = max(-(-sum(t) // N), -(-max(t, default=0) // (N - K + 1 if self.replicating
                                                                   else 1)))
            rows = [row for _, row, _ in enforced] if self.replicating else self.time_terms
            upper = self.upper_ticks if self.upper_ticks is not None else max(
                1, sum(abs(c) for terms in rows for c, _ in terms))
            self.T = m.new_int_var(min(lower, upper), upper, "T")
            if self.replicating:
                for y, time_row, memory_row in enforced:
                    m.add(expr(time_row) <= self.T).only_enforce_if(y)
                    if limited:
                        m.add(expr(memory_row) <= int(p.memory_limit)).only_enforce_if(y)
            else:
                for gpu_time in self.time_terms:
                    m.add(expr(gpu_time) <= self.T)
                if limited:
                    for gpu_memory in self.memory_terms:
                        m.add(expr(gpu_memory) <= int(p.memory_limit))
            m.minimize(self.T)
        else:
            upper = max(self.terms.range(gpu_memory)[1] for gpu_memory in self.memory_terms)
            self.T = m.new_int_var(0, max(0, upper), "memory")
            for gpu_memory in self.memory_terms:
                m.add(expr(gpu_memory) <= self.T)
            m.minimize(self.T)

        if hint is not None:
            self._add_hints(hint)

    # -- building blocks -------------------------------------------------------------

    def _x(self, g: int, j: int) -> Terms:
        """x[g,j] = d[g,j] - d[g,j-1] as terms."""
        if j == 0:
            return [(1, self.d[g][0])]
        return [(1, self.d[g][j]), (-1, self.d[g][j - 1])]

    # -- hints ---------------------------------------------------------------------------

    def _loss_bytes(self, j: int, keep: int) -> int:
        """The loss's bytes on stage j (the last one), ``keep`` micro-batches of its saved."""
        p = self.problem
        if j != self.num_stages - 1:
            return 0
        return p.loss_saved_bytes * keep + p.loss_grad_bytes

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
        self._hint_recompute = evaluation.recompute
        if not evaluation.estimate.fits:
            return None
        return math.ceil(evaluation.bottleneck_s * self.scale + self._rounding_terms * 0.5)

    def _values(self, assignment: Sequence[int], recompute: Sequence[bool],
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
        for j, z in enumerate(self.z):
            if not isinstance(z, int):
                values[z.index] = int(recompute[j])
                variables[z.index] = z
        self.terms.least_values(values, variables)
        return values, variables

    def rows_at(self, assignment: Sequence[int], recompute: Sequence[bool],
                ) -> tuple[list[int], list[int]]:
        """Each GPU's time row (ticks) and memory row (bytes) at a coarse assignment and
        recompute choice: the linear form of the stage cost formula, which tests hold
        against ``evaluate``. One GPU per stage (not replicated) only."""
        assert not self.replicating
        values, _ = self._values(assignment, recompute)
        return ([total(row, values) for row in self.time_terms],
                [total(row, values) for row in self.memory_terms])

    def _add_hints(self, hint: Sequence[int]) -> None:
        """Hint every variable: d from the assignment, z from ``evaluate``'s recompute
        choice for it, indicators from their definitions."""
        if self.replicating or not self._hint_is_valid(hint):
            return
        recompute = self._hint_recompute
        if recompute is None:
            recompute = evaluate(self.problem, self.coarsening.expand(hint)).recompute
        values, variables = self._values(hint, recompute)
        for index, hinted in values.items():
            self.model.add_hint(variables[index], hinted)
        rows = self.time_terms if self.objective == "time" else self.memory_terms
        top = max(total(row, values) for row in rows)
        domain = self.T.proto.domain
        if domain[0] <= top <= domain[-1]:
            self.model.add_hint(self.T, top)

    # -- solving ---------------------------------------------------------------------------

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
        solver = search.solver
        name = solver.status_name(search.status)
        if not search.found:
            return IlpResult(name, None, None, math.inf, 0.0, search.wall_s, self.num_nodes,
                             wall_clock_stopped=search.wall_clock_stopped)
        unit = self.scale if self.objective == "time" else 1
        margin = self._rounding_terms * 0.5 / unit if self.objective == "time" else 0.0
        coarse = tuple(
            sum(1 for v in row[:-1] if (v if isinstance(v, int) else solver.value(v)) == 0)
            for row in self.d
        )
        objective = solver.objective_value / unit
        bound = max(0.0, solver.best_objective_bound / unit - margin)
        replicas = tuple(next(r for r, y in row.items() if solver.value(y)) for row in self.y)
        recompute = tuple(bool(value(z, {}) if isinstance(z, int) else solver.value(z))
                          for z in self.z)
        return IlpResult(name, coarse, self.coarsening.expand(coarse), objective,
                         min(bound, objective), search.wall_s, self.num_nodes, replicas or None,
                         recompute, wall_clock_stopped=search.wall_clock_stopped)
