"""Running CP-SAT: a deterministic search (the same answer at any load), a wall-clock
safety net, a stop that another thread (a signal watcher) may call, and a process of its
own, so that OR-Tools failing its own checks ends the search, not fxpipe.

OR-Tools 9.15 aborts the process on some programs ("Check failed:
heuristics.fixed_search != nullptr", Llama-3-70B's exact groups at --gpus 64 --pp 8
--tp 8: a subsolver proves the program infeasible while it loads, which the hint shows
it is not). On Linux a search of ISOLATE_FROM variables or more therefore runs in a
forked child (``fxpipe.forked.isolated``), which sends back its status, bounds and
values; a child that dies sends nothing, and the search is UNKNOWN (the caller keeps the
split it had, with its proved gap) with a warning naming how it ended. A smaller search,
and any search elsewhere, runs in this process."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from dataclasses import dataclass

from ortools.sat.python import cp_model

from fxpipe.forked import isolated

__all__ = ["Search", "run_search", "stop_searches"]

_RUNNING: set[cp_model.CpSolver] = set()  # searches in progress here, for stop_searches
_CHILDREN: set[int] = set()  # processes searching, for stop_searches

# How long past its wall-clock limit a child may take to answer before it is killed
# (its program arrives by fork, its answer is a few kilobytes).
_GRACE_S = 30.0
# Variables from which a search runs in a child: below, it takes milliseconds and a fork
# costs more (75 ms from a 1.2 GiB process, torch loaded: 1.1 ms for the search of a
# tiny program in the process, 76 ms in a child), and the programs OR-Tools 9.15 was seen
# to abort on had 2,960 and 22,168.
ISOLATE_FROM = 2_000


def stop_searches() -> None:
    """Stop every search in progress; each returns its best solution so far (a child
    stopped before its search began returns none). Safe from another thread (a signal
    watcher): CP-SAT's stop is thread-safe, and a child stops on SIGINT."""
    for solver in list(_RUNNING):
        solver.stop_search()
    for pid in list(_CHILDREN):
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            os.kill(pid, signal.SIGINT)


@dataclass(frozen=True)
class Search:
    """A finished search: CP-SAT's status name and, where one was found, the values of
    the program's variables (by index) and its objective and bound."""

    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, MODEL_INVALID
    solution: tuple[int, ...]
    objective: float
    bound: float
    wall_s: float
    wall_clock_stopped: bool  # the wall-clock safety net, not the work limit, ended it

    @property
    def found(self) -> bool:
        return self.status in ("OPTIMAL", "FEASIBLE")

    def value(self, term: int | cp_model.IntVar) -> int:
        """The value the search gave ``term`` (a constant is itself)."""
        if isinstance(term, int):
            return term
        return self.solution[term.index]


def run_search(model: cp_model.CpModel, *, work_limit: float, time_limit_s: float,
               workers: int, log: bool) -> Search:
    """Search within ``work_limit`` units of CP-SAT's deterministic time, stopped by the
    wall clock after ``time_limit_s`` at the latest."""
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(0.001, work_limit)
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    solver.parameters.num_workers = workers
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
    if len(model.proto.variables) < ISOLATE_FROM:
        return _search(solver, model, own_process=True)
    return _search_in_child(solver, model, time_limit_s)


def _search(solver: cp_model.CpSolver, model: cp_model.CpModel, *,
            own_process: bool) -> Search:
    """``solver`` run on ``model`` in this process. Here (``own_process``) CP-SAT's own
    SIGINT catching would swallow Ctrl-C and leave SIGINT at the default afterwards: a
    search stops by ``stop_searches`` (fxpipe.signals). A child stops on SIGINT itself."""
    solver.parameters.catch_sigint_signal = not own_process
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
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    solution = tuple(solver.response_proto.solution) if found else ()
    return Search(solver.status_name(status), solution,
                  solver.objective_value if found else 0.0,
                  solver.best_objective_bound if found else 0.0, wall, wall_clock)


def _search_in_child(solver: cp_model.CpSolver, model: cp_model.CpModel,
                     time_limit_s: float) -> Search:
    """``_search`` in a forked child (``fxpipe.forked.isolated``; in this process where no
    child can be made); UNKNOWN, with a warning, where the child dies or outlives the wall
    clock by ``_GRACE_S``."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        # Python 3.12 warns of fork() in a process with threads (torch's, a signal
        # watcher): the child runs only CP-SAT on its copy of the program and writes to a
        # pipe, and a child that hangs is killed after the wall clock and _GRACE_S.
        warnings.simplefilter("ignore", DeprecationWarning)
        parent = os.getpid()  # where no child can be made, the search runs here
        answer = isolated(lambda: _search(solver, model, own_process=os.getpid() == parent),
                          wait_s=time_limit_s + _GRACE_S, running=_CHILDREN)
    if isinstance(answer, Search):
        return answer
    # a stop asked for (stop_searches, Ctrl-C) is no failure
    if answer.signal not in (signal.SIGINT, signal.SIGTERM):
        how = ("outlived its wall-clock limit and " + answer.how if answer.timed_out
               else answer.how)
        warnings.warn(f"the CP-SAT search {how}, without an answer (OR-Tools "
                      f"{_ortools_version()}); the split is the best found without it, "
                      f"with its proved gap", RuntimeWarning, stacklevel=3)
    wall = time.perf_counter() - start
    return Search("UNKNOWN", (), 0.0, 0.0, wall, wall_clock_stopped=answer.timed_out)


def _ortools_version() -> str:
    import ortools

    return str(getattr(ortools, "__version__", "?"))
