"""Work in a forked child (fxpipe.forked): its answer comes back, computed in the child
where one can be made, and the parent does the work itself whenever the child gives no
answer: it fails, cannot pickle what it made, or takes too long. Isolated work (which may
kill its process) is never done again: a child that dies is a ``Died`` saying how."""

from __future__ import annotations

import os
import time

import pytest

from fxpipe import forked
from fxpipe.forked import Forked

PARENT = os.getpid()
fork = pytest.mark.skipif(not forked._can_fork(), reason="no child is made on this machine "
                          "(one core, not Linux, or CUDA initialized)")


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@fork
def test_the_answer_is_made_in_a_child_that_shares_the_parents_objects() -> None:
    shared = ["as at the fork"]

    def work() -> tuple[int, int, str]:
        mine = shared[0]
        shared[0] = "changed in the child"
        return os.getpid(), id(shared), mine

    with Forked(work) as job:
        pid, where, seen = job.result()
    assert pid != PARENT
    assert where == id(shared) and seen == "as at the fork"
    assert shared == ["as at the fork"]  # the child's change stays in the child
    assert _reaped(pid)


def test_without_a_child_the_work_is_done_when_its_answer_is_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked, "_can_fork", lambda: False)
    calls: list[int] = []
    job = Forked(lambda: calls.append(os.getpid()) or len(calls))
    assert calls == []
    assert job.result() == 1 and job.result() == 1
    assert calls == [PARENT]


def test_a_fork_that_fails_leaves_the_work_to_the_parent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fork() -> int:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(forked, "_can_fork", lambda: True)
    monkeypatch.setattr(os, "fork", no_fork)
    with Forked(os.getpid) as job:
        assert job.result() == PARENT


def test_work_too_small_for_a_child_is_done_when_asked() -> None:
    calls: list[int] = []
    job = Forked(lambda: calls.append(os.getpid()) or len(calls), in_child=False)
    assert calls == [] and job.result() == 1 and calls == [PARENT]


@fork
@pytest.mark.parametrize("fails", ["raises", "unpicklable"])
def test_a_child_that_gives_no_answer_leaves_the_work_to_the_parent(fails: str) -> None:
    def work() -> object:
        if os.getpid() == PARENT:
            return "the parent's"
        if fails == "raises":
            raise RuntimeError("only in the child")
        return lambda: None  # pickle cannot send a lambda

    with Forked(work) as job:
        assert job.result() == "the parent's"


@fork
def test_a_child_that_takes_too_long_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked, "WAIT_S", 0.5)

    def work() -> str:
        if os.getpid() != PARENT:
            time.sleep(60)
        return "the parent's"

    start = time.monotonic()
    with Forked(work) as job:
        pid = job._pid
        assert job.result() == "the parent's"
    assert time.monotonic() - start < 30
    assert pid is not None and _reaped(pid)


@fork
def test_a_child_not_asked_for_its_answer_is_stopped_at_the_end_of_the_block() -> None:
    with Forked(lambda: time.sleep(60)) as job:
        pid = job._pid
    assert pid is not None and _reaped(pid)


@fork
def test_ready_says_whether_the_answer_waits_on_the_child() -> None:
    """Not while the child works; once it has answered; and always after the answer was
    taken."""
    with Forked(lambda: time.sleep(0.5) or 7) as job:
        assert not job.ready()
        deadline = time.monotonic() + 30
        while not job.ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.ready()
        assert job.result() == 7
        assert job.ready()


def test_ready_is_false_without_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """The work is then done when the answer is asked for: not ready before."""
    monkeypatch.setattr(forked, "_can_fork", lambda: False)
    with Forked(lambda: 7) as job:
        assert not job.ready()
        assert job.result() == 7
        assert job.ready()


linux = pytest.mark.skipif(os.uname().sysname != "Linux", reason="isolated work runs in a "
                           "child on Linux only")


@linux
def test_isolated_work_answers_from_a_child_and_leaves_it_reaped() -> None:
    running: set[int] = set()
    child = forked.isolated(os.getpid, wait_s=30, running=running)
    assert isinstance(child, int) and child != PARENT
    assert _reaped(child) and not running  # held while it ran, dropped once reaped


@linux
def test_isolated_work_that_kills_its_process_is_a_death_said_and_not_done_again() -> None:
    def abort() -> None:
        if os.getpid() == PARENT:
            raise AssertionError("done again in the parent")
        os.abort()  # as OR-Tools 9.15's failed checks do

    died = forked.isolated(abort, wait_s=30)
    assert died == forked.Died("ended on SIGABRT", 6)


@linux
def test_isolated_work_past_its_wait_is_killed() -> None:
    start = time.monotonic()
    died = forked.isolated(lambda: time.sleep(60), wait_s=0.5)
    assert time.monotonic() - start < 10
    assert isinstance(died, forked.Died) and died.timed_out
    assert died.how == "was killed after 0.5 s"


@linux
def test_an_interrupt_while_waiting_leaves_no_isolated_child_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fxpipe.signals raises in the waiting parent: the child is killed and reaped, not
    left to run on after the process has exited."""
    running: set[int] = set()
    children: list[int] = []
    select = forked.select.select

    def interrupted(*args: object) -> object:
        children.extend(running)
        raise KeyboardInterrupt

    monkeypatch.setattr(forked.select, "select", interrupted)
    with pytest.raises(KeyboardInterrupt):
        forked.isolated(lambda: time.sleep(60), wait_s=60, running=running)
    monkeypatch.setattr(forked.select, "select", select)
    (pid,) = children
    assert _reaped(pid) and not running
