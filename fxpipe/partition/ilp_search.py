"""Running CP-SAT: a deterministic search (the same answer at any load), a wall-clock
safety net, and a stop that another thread (a signal watcher) may call."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

__all__ = ["Search", "run_search", "stop_searches"]

_RUNNING: set[cp_model.CpSolver] = set()  # searches in progress, for stop_searches


def stop_searches() -> None:
    """Stop every search in progress; each returns its best solution so far. Safe from
    another thread (a signal watcher): CP-SAT's stop is thread-safe."""
    for solver in list(_RUNNING):
        solver.stop_search()


@dataclass(frozen=True)
class Search:
    """A finished search: the solver holds its values and bounds."""

    solver: cp_model.CpSolver
    status: cp_model.CpSolverStatus
    wall_s: float
    wall_clock_stopped: bool  # the wall-clock safety net, not the work limit, ended it

    @property
    def found(self) -> bool:
        return self.status in (cp_model.OPTIMAL, cp_model.FEASIBLE)


def run_search(model: cp_model.CpModel, *, work_limit: float, time_limit_s: float,
               workers: int, log: bool) -> Search:
    """Search within ``work_limit`` units of CP-SAT's deterministic time, stopped by the
    wall clock after ``time_limit_s`` at the latest."""
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(0.001, work_limit)
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    solver.parameters.num_workers = workers
    # CP-SAT's own SIGINT catching swallows Ctrl-C and leaves SIGINT at the default
    # afterwards; the caller stops a search with ``stop_searches`` (fxpipe.signals).
    solver.parameters.catch_sigint_signal = False
    # Workers interleaved in one deterministic order, stopped by deterministic time and
    # seeded alike: the same problem gives the same split on every run, at any load
    # (plan.json and the generated stages are reproducible).
    solver.parameters.interleave_search = True
    solver.parameters.random_seed = 0
    # No symmetry detection: in OR-Tools 9.15 it proved a stage program INFEASIBLE that has
    # a solution (Llama-3-70B's coarse graph at --pp 4 --tp 8; OPTIMAL without it, with
    # every variable fixed to that solution too), and with interleaved workers it aborts
    # the process ("Check failed: heuristics.fixed_search != nullptr"): a wrong "nothing
    # fits" or a dead fxpipe. tests/partition/test_cpsat_symmetry.py holds that program.
    solver.parameters.symmetry_level = 0
    solver.parameters.log_search_progress = log
    start = time.perf_counter()
    _RUNNING.add(solver)
    try:
        status = solver.solve(model)
    finally:
        _RUNNING.discard(solver)
    wall = time.perf_counter() - start
    # Neither proved nor out of work: the wall clock stopped it.
    wall_clock = (status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
                  and solver.deterministic_time < solver.parameters.max_deterministic_time)
    return Search(solver, status, wall, wall_clock)
