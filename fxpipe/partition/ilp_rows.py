"""Stage j's time and memory on r replicas as rows over x[g,j]: the stage cost formula
(``fxpipe.partition.cost``) in the linear form the CP-SAT program (ilp.py) bounds, with
the indicators it needs: where values travel (cu, cd or r, o), what a stage keeps for a
later one (e), its largest backward transient (B), and the copies of tied parameters (u, m,
a). Recompute (z, A, R) is chosen by the program, which adds it to these rows.
"""

from __future__ import annotations

from fxpipe.partition.cost import Option, run_again_s, saved_activations
from fxpipe.partition.ilp_inputs import GroupCosts, ValueClass
from fxpipe.partition.ilp_terms import Term, TermBuilder, Terms
from fxpipe.partition.problem import Comm, Problem, allreduce_terms, stage_deferred, stage_flights
from fxpipe.plan import StageRecompute

__all__ = ["StageRows"]


def _minus(terms: Terms) -> Terms:
    return [(-c, v) for c, v in terms]


class StageRows:
    """Per-stage terms over the cumulative indicators ``d`` (d[g,j] = [stage(g) <= j]).
    ``memory_counts``: whether memory is limited or minimised (else e and B are left out).
    The indicator families are added in the order ``__init__`` lists them."""

    def __init__(self, problem: Problem, costs: GroupCosts, classes: list[ValueClass],
                 scale: int, terms: TermBuilder, d: list[list[Term]], *,
                 memory_counts: bool) -> None:
        self.problem = problem
        self.costs = costs
        self.classes = classes
        self.scale = scale
        self.terms = terms
        self.d = d
        self.all_stages = range(problem.num_stages)
        self.boundaries = range(problem.num_stages - 1)
        self.all_nodes = range(len(d))
        self.flight = list(stage_flights(problem))  # per stage: micro-batches in flight
        self.waiting = list(stage_deferred(problem))  # per stage: waiting weight gradients
        self.stash = problem.schedule.spec.stashes_weights  # a weight copy per micro-batch
        # per stage: ticks of transfers and tied all-reduces (compute is added per
        # replica count), bytes received, (bytes, e[k,j]) kept for later stages, B[j],
        # bytes of tied parameters' copies
        self.comm_time: list[Terms] = [[] for _ in self.all_stages]
        self.received: list[Terms] = [[] for _ in self.all_stages]
        self.sent: list[Terms] = [[] for _ in self.all_stages]
        self.peak: list[Term] = [0 for _ in self.all_stages]
        self.tied_memory: list[Terms] = [[] for _ in self.all_stages]
        self._add_transfers()
        if memory_counts:
            self._add_kept_outputs()
            self._add_backward_peaks()
        self._add_tied()

    def x(self, g: int, j: int) -> Terms:
        """x[g,j] = d[g,j] - d[g,j-1] = [stage(g) == j] as terms."""
        if j == 0:
            return [(1, self.d[g][0])]
        return [(1, self.d[g][j]), (-1, self.d[g][j - 1])]

    # -- indicators -----------------------------------------------------------------------------

    def _add_transfers(self) -> None:
        """Each value class's transport indicators. A transfer costs its ticks to the
        stages that send and receive it, and its bytes to the stage that receives it."""
        for k in self.classes:
            c, s = round(k.comm_s * self.scale), round(k.out_bytes)
            if self.problem.comm is Comm.NEIGHBOUR:
                self._add_neighbour_transfers(k, c, s)
            else:
                self._add_direct_transfers(k, c, s)

    def _add_neighbour_transfers(self, k: ValueClass, c: int, s: int) -> None:
        # cu[k,b] >= d[g,b] - d[w,b] for w in W: the values go up across boundary b;
        # cd[k,b] >= d[w,b] - d[g,b] for w in Wu: they come down across it.
        g, d = k.producer, self.d
        cu = [self.terms.at_least([[(1, d[g][b]), (-1, d[w][b])] for w in k.readers],
                                  f"cu[{g},{b}]") for b in self.boundaries]
        cd = [self.terms.at_least([[(1, d[w][b]), (-1, d[g][b])] for w in k.unordered],
                                  f"cd[{g},{b}]") for b in self.boundaries]
        for b in self.boundaries:
            # a crossing of boundary b costs its sender and its receiver
            for j in (b, b + 1):
                self.comm_time[j] += [(c, cu[b]), (c, cd[b])]
            self.received[b + 1].append((s, cu[b]))
            self.received[b].append((s, cd[b]))

    def _add_direct_transfers(self, k: ValueClass, c: int, s: int) -> None:
        # r[k,j] >= x[w,j] - x[g,j]: stage j receives the values;
        # o[k,j] >= x[g,j] - x[w,j]: stage j sends them (w in W).
        g = k.producer
        for j in self.all_stages:
            xg = self.x(g, j)
            r = self.terms.at_least([self.x(w, j) + _minus(xg) for w in k.readers],
                                    f"r[{g},{j}]")
            o = self.terms.at_least([xg + _minus(self.x(w, j)) for w in k.readers],
                                    f"o[{g},{j}]")
            self.comm_time[j] += [(c, r), (c, o)]
            self.received[j].append((s, r))

    def _add_kept_outputs(self) -> None:
        """e[k,j] >= x[g,j] - d[w,j] for w in W: stage j produces the values and a later
        stage reads them, so j keeps them until their backward."""
        for k in self.classes:
            if not k.sent_bytes:
                continue
            g = k.producer
            for j in self.boundaries:
                kept = self.terms.at_least(
                    [[*self.x(g, j), (-1, self.d[w][j])] for w in k.readers], f"e[{g},{j}]")
                self.sent[j].append((round(k.sent_bytes), kept))

    def _add_backward_peaks(self) -> None:
        """B[j] >= grad[g] * x[g,j]: the largest backward transient on stage j."""
        grad = self.costs.grad
        self.peak = [self.terms.max_of([[(grad[g] * c, v) for c, v in self.x(g, j)]
                                        for g in self.all_nodes if grad[g]], f"B[{j}]")
                     for j in self.all_stages]

    def _add_tied(self) -> None:
        """Replicated tied parameters: u[G,j] >= x[h,j] for each holder h, m[G] >= u[G,j] -
        x[first holder,j], a[G,j] >= u[G,j] + m[G] - 1. A copy's bytes on every stage that
        holds one, an all-reduce on each when there is more than one."""
        for tied, holders in self.costs.copied:
            name = tied.name
            uses = [self.terms.at_least([self.x(h, j) for h in holders], f"u[{name},{j}]")
                    for j in self.all_stages]
            first = holders[0]
            multi = self.terms.at_least(
                [[(1, uses[j]), *_minus(self.x(first, j))] for j in self.all_stages],
                f"m[{name}]")
            ticks = round(tied.allreduce_s * self.scale)
            size = round(tied.param_bytes * self.costs.state)
            for j in self.all_stages:
                allreduce = self.terms.at_least([[(1, uses[j]), (1, multi), (-1, 1)]],
                                                f"a[{name},{j}]")
                self.comm_time[j].append((ticks, allreduce))
                copies = tied.param_bytes * self.flight[j] if self.stash else 0
                self.tied_memory[j].append((size + copies, uses[j]))

    # -- the stage cost formula ---------------------------------------------------------------

    def time(self, j: int, r: int) -> Terms:
        """Stage j's ticks on r replicas but a recomputed forward: compute (with the
        all-reduce of its parameters' gradients when r > 1), transfers, tied all-reduces."""
        return self._compute(j, r) + self.comm_time[j]

    def _compute(self, j: int, r: int) -> Terms:
        if r == 1:
            return [(self.costs.ticks[g] * c, v) for g in self.all_nodes for c, v in self.x(g, j)]
        costs, scale = self.costs, self.scale
        per_byte, fixed = allreduce_terms(self.problem, r)
        ticks = [round(costs.secs[g] / r * scale) + round(costs.params[g] * per_byte * scale)
                 for g in self.all_nodes]
        return [(ticks[g] * c, v) for g in self.all_nodes for c, v in self.x(g, j)] + [
            (round(fixed * scale), 1)]

    def saved(self, j: int, r: int, recompute: Option) -> Terms:
        """Stage j's saved activations and loss on each of r replicas, as ``recompute``
        keeps them (``cost.saved_activations``)."""
        costs, flight = self.costs, self.flight[j]
        mode, level = recompute
        saved = [int(saved_activations(mode, costs.act[g], costs.selective[g][level], flight))
                 for g in self.all_nodes]
        keep = 1 if mode is StageRecompute.FULL else flight
        return [(-(-saved[g] // r) * c, v) for g in self.all_nodes if saved[g]
                for c, v in self.x(g, j)] + [(-(-self._loss_bytes(j, keep) // r), 1)]

    def _loss_bytes(self, j: int, keep: int) -> int:
        """The loss's bytes on stage j (the last one), ``keep`` micro-batches of its saved."""
        p = self.problem
        if j != p.num_stages - 1:
            return 0
        return p.loss_saved_bytes * keep + p.loss_grad_bytes

    def run_again(self, j: int, r: int, recompute: Option) -> Terms:
        """Stage j's forward seconds run again in its backward (``cost.run_again_s``)."""
        costs, (mode, level) = self.costs, recompute
        again = [float(run_again_s(mode, costs.fwd[g], costs.selective_fwd[g][level]))
                 for g in self.all_nodes]
        ticks = [round(a / r * self.scale) for a in again]
        return [(ticks[g] * c, v) for g in self.all_nodes if ticks[g] for c, v in self.x(g, j)]

    def memory(self, j: int, r: int) -> Terms:
        """Stage j's bytes on each of r replicas but its saved activations and loss
        (received, outputs / r; the backward transient whole)."""
        costs, flight = self.costs, self.flight[j]
        outs = flight + 1  # kept per micro-batch in flight, + one of their gradients
        per_group = [((costs.state_bytes[g] + costs.held[g] * flight * self.stash
                       + -(-costs.returned[g] * outs // r)
                       + -(-costs.deferred[g] * self.waiting[j] // r)) * c, v)
                     for g in self.all_nodes for c, v in self.x(g, j)]
        received = [(-(-s * flight // r), v) for s, v in self.received[j]]
        sent = [(-(-s * outs // r), v) for s, v in self.sent[j]]
        return (per_group + received + sent + self.tied_memory[j]
                + [(1, self.peak[j]), (self.problem.workspace_bytes, 1)])
