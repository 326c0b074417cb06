"""Rows of the CP-SAT program (ilp.py) as lists of (coefficient, variable or constant)
terms, and the auxiliary variables they define.

A row is kept as ``Terms`` rather than built as a CP-SAT expression so that a variable
its stage range fixes is just an int, a row's range is known before it is added (a row
that always holds is dropped, an indicator its rows decide is a constant), and a row
can be evaluated at any assignment (hints, ``StageModel.rows_at``).
"""

from __future__ import annotations

from ortools.sat.python import cp_model

__all__ = ["Literals", "Term", "TermBuilder", "Terms", "expr", "total", "value"]

Term = int | cp_model.IntVar
Terms = list[tuple[int, Term]]  # sum of coefficient * (variable or constant)
Literals = list[tuple[cp_model.IntVar, bool]]  # (0/1 variable, the value that enforces a row)


def expr(terms: Terms) -> cp_model.LinearExprT:
    # One weighted sum rather than a chain of additions: building the model of a
    # 5,000-node graph took longer than solving it.
    constant = sum(c * v for c, v in terms if isinstance(v, int))
    live = [(c, v) for c, v in terms if not isinstance(v, int)]
    if not live:
        return constant
    return cp_model.LinearExpr.weighted_sum([v for _, v in live],
                                            [c for c, _ in live]) + constant


def value(term: Term, values: dict[int, int]) -> int:
    """A term's value where each variable (by index) takes ``values``."""
    return term if isinstance(term, int) else values[term.index]


def total(terms: Terms, values: dict[int, int]) -> int:
    """A row's value where each variable (by index) takes ``values``."""
    return sum(c * value(v, values) for c, v in terms)


class TermBuilder:
    """Adds rows to a CP-SAT model, and the auxiliary variables they define: each is only
    bounded from below by its rows, so at an optimum, and in ``least_values``, it takes
    the least value they allow."""

    def __init__(self, model: cp_model.CpModel) -> None:
        self.model = model
        self._int_bounds: dict[int, tuple[int, int]] = {}  # variable index -> domain, non-0/1
        self._defs: list[tuple[cp_model.IntVar, list[Terms]]] = []  # aux var >= each Terms
        # aux var >= each Terms whose literals (variable, value that enforces it) all hold
        self._enforced: list[tuple[cp_model.IntVar, list[tuple[Terms, Literals]]]] = []

    def range(self, terms: Terms) -> tuple[int, int]:
        """The smallest and largest value ``terms`` can take."""
        lo = hi = 0
        bounds = self._int_bounds
        for c, v in terms:
            if isinstance(v, int):
                lo += c * v
                hi += c * v
                continue
            least, most = bounds.get(v.index, (0, 1)) if bounds else (0, 1)
            if c >= 0:
                lo += c * least
                hi += c * most
            else:
                lo += c * most
                hi += c * least
        return lo, hi

    def add_le(self, left: Terms, right: Terms) -> None:
        """left <= right, unless it always holds."""
        terms = left + [(-c, v) for c, v in right]
        lo, hi = self.range(terms)
        if hi <= 0:
            return  # always true
        assert lo <= 0, "contradictory fixed variables"
        self.model.add(expr(terms) <= 0)

    def at_least(self, rows: list[Terms], name: str) -> Term:
        """A 0/1 indicator >= every row (a constant when the rows decide it)."""
        live = []
        for row in rows:
            lo, hi = self.range(row)
            if lo >= 1:
                return 1
            if hi >= 1:
                live.append(row)
        if not live:
            return 0
        var = self.model.new_bool_var(name)
        for row in live:
            self.model.add(var >= expr(row))
        self._defs.append((var, live))
        return var

    def max_of(self, rows: list[Terms], name: str) -> Term:
        """A non-negative integer >= every row (a constant when the rows decide it)."""
        ranges = [self.range(row) for row in rows]
        least = max([0] + [lo for lo, _ in ranges])
        most = max([least] + [hi for _, hi in ranges])
        live = [row for row, (_, hi) in zip(rows, ranges, strict=True) if hi > least]
        if not live:
            return least
        var = self.model.new_int_var(least, most, name)
        self._int_bounds[var.index] = (least, most)
        for row in live:
            self.model.add(var >= expr(row))
        self._defs.append((var, live))
        return var

    def max_where(self, rows: list[tuple[Terms, list[tuple[Term, bool]]]], name: str) -> Term:
        """A non-negative integer >= each row whose literals (a 0/1 variable or constant,
        and the value that enforces the row) all hold."""
        live: list[tuple[Terms, Literals]] = []
        for row, literals in rows:
            if any(isinstance(v, int) and bool(v) != want for v, want in literals):
                continue  # never enforced
            live.append((row, [(v, want) for v, want in literals
                               if isinstance(v, cp_model.IntVar)]))
        most = max([0] + [self.range(row)[1] for row, _ in live])
        var = self.model.new_int_var(0, most, name)
        self._int_bounds[var.index] = (0, most)
        for row, enforcing in live:
            constraint = self.model.add(var >= expr(row))
            if enforcing:
                constraint.only_enforce_if([v if want else v.Not() for v, want in enforcing])
        self._enforced.append((var, live))
        return var

    def least_values(self, values: dict[int, int],
                     variables: dict[int, cp_model.IntVar]) -> None:
        """Add to ``values`` (and ``variables``, by index) every auxiliary variable at the
        least its rows allow, given the decision variables' values already there."""
        for var, rows in self._defs:  # created after everything they read
            least, _ = self._int_bounds.get(var.index, (0, 1))
            values[var.index] = max(least, *(total(row, values) for row in rows))
            variables[var.index] = var
        for var, enforced in self._enforced:  # read only decision variables
            values[var.index] = max([0] + [
                total(row, values) for row, literals in enforced
                if all(values[lit.index] == want for lit, want in literals)])
            variables[var.index] = var
