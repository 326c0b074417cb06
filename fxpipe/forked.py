"""Work done in a forked child while the parent goes on, its answer pickled back.

Some steps run independent pieces of Python that each take a second or more: tracing a
model of repeated layers records the whole model's run and exports the cut one
(``tracing/repeats.py``); ``symbolic_trace``'s graph is run once to check it and once
per input size to learn which may vary (``tracing/symbolic.py``); when nothing fits, the
graph's bytes are costed again at each leaner precision (``advice.py``). A forked
child shares the parent's objects as they were at the fork, with their ids, so it can
run one piece on the same model while the parent runs another, on a second core.

A fork is made only where it is safe and can gain: on Linux, with more than one core
available to the process, and with CUDA not initialized (a forked child cannot use it).
Elsewhere the work is done when its answer is asked for. A child that fails, cannot
pickle its answer or does not answer within ``WAIT_S`` of being asked is no answer: the
parent then does the work itself, so the result is the same as without a child, only
slower.

``isolated`` is the other use of a child: work that may kill the process it runs in (a
library's own check aborting it, CP-SAT's in OR-Tools 9.15), run in a child of its own
and waited for, on Linux whatever the cores. A child that dies is ``Died``, saying how,
and the work is not done again.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["FORK_MIN_NODES", "Died", "Forked", "isolated"]

T = TypeVar("T")

# Graph nodes from which a pass over a graph is worth a child: the passes that fork take
# 0.3-0.4 ms a node on two cores (running it on fake tensors, writing its code), a fork
# 25 ms with torch loaded.
FORK_MIN_NODES = 500

# The longest the parent waits for the child's answer once it asks for it (seconds). The
# whole-model record of an 80-layer Llama-3-70B takes 4 s on two cores, its bytes at
# bf16-mixed 5 s.
WAIT_S = 120.0


class Forked(Generic[T]):
    """``work()`` run in a forked child (see the module docstring); ``result()`` is its
    answer, or ``work()``'s in the parent where no child was made or it gave none. Used
    as a context manager: a child not asked for its answer by the end of the block is
    stopped."""

    def __init__(self, work: Callable[[], T], *, in_child: bool = True) -> None:
        """``in_child``: False where the work is too small to pay for a fork (25 ms with
        torch loaded): it is then done when asked, as where no child can be made."""
        self._work = work
        self._pid: int | None = None
        self._pipe = -1
        self._done: tuple[T] | None = None
        if in_child and _can_fork():
            child = _fork(work, alone=False)
            if child is not None:  # else the work is done when asked
                self._pid, self._pipe = child

    def __enter__(self) -> Forked[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pid is not None:
            pid, self._pid = self._pid, None
            os.close(self._pipe)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)

    def ready(self) -> bool:
        """Whether ``result()`` would answer without waiting for work: it has, or the
        child has begun to write its answer (or ended). False where no child was made:
        the work is then done when asked."""
        if self._done is not None:
            return True
        return self._pid is not None and bool(select.select([self._pipe], [], [], 0)[0])

    def result(self) -> T:
        if self._done is None:
            self._done = self._collect() or (self._work(),)
        return self._done[0]

    def _collect(self) -> tuple[T] | None:
        """The child's answer as a 1-tuple; None where there is no child or no answer."""
        if self._pid is None:
            return None
        pid, self._pid = self._pid, None
        return _collect(pid, self._pipe, time.monotonic() + WAIT_S)[0]


@dataclass(frozen=True)
class Died:
    """An ``isolated`` child that gave no answer, and how it ended."""

    how: str  # "ended on SIGABRT", "exited with status 1", "was killed after 30 s"
    signal: int | None = None  # the signal that ended it, where one did
    timed_out: bool = False


def isolated(work: Callable[[], T], *, wait_s: float, running: set[int] | None = None
             ) -> T | Died:
    """``work()`` in a forked child, waited for up to ``wait_s``: its answer, or ``Died``
    where the child ended without one (killed at ``wait_s``). The child's SIGINT and
    SIGTERM are the default, its own to catch, and not the parent's watcher's
    (``fxpipe.signals``). ``running`` holds the child's pid while it runs (to signal
    it). In this process where no child can be made (not Linux, no process slot)."""
    child = _fork(work, alone=True) if sys.platform == "linux" else None
    if child is None:
        return work()
    pid, read = child
    if running is not None:
        running.add(pid)
    answer: tuple[T] | None
    try:
        answer, status = _collect(pid, read, time.monotonic() + wait_s)
    finally:
        if running is not None:
            running.discard(pid)
    if answer is not None:
        return answer[0]
    if status is None:
        return Died(f"was killed after {wait_s:g} s", int(signal.SIGKILL), timed_out=True)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return Died(f"ended on {name}", number)
    return Died(f"exited with status {os.WEXITSTATUS(status)}")


def _fork(work: Callable[[], T], *, alone: bool) -> tuple[int, int] | None:
    """A forked child answering ``work()`` on a pipe: its (pid, read end); None where no
    child can be made (no memory or process slot). ``alone``: the child's SIGINT and
    SIGTERM are the default and its own, not the parent's watcher's, and a crash prints
    no Python stack (a library that aborts says why)."""
    read, write = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        return None
    if pid == 0:  # the child: answer through the pipe, then leave without cleanup
        os.close(read)
        if alone:
            faulthandler.disable()
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_DFL)
        _answer(work, write)
    os.close(write)
    return pid, read


def _collect(pid: int, pipe: int, deadline: float) -> tuple[tuple[T] | None, int | None]:
    """Child ``pid``'s answer on ``pipe`` as a 1-tuple (None: no answer), and its wait
    status (None where it was killed at ``deadline``). The child is reaped whatever
    happens, killed first where it has not answered (an interrupt while waiting too)."""
    data = bytearray()
    answered = timed_out = False
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([pipe], [], [], left)[0]:
                break
            chunk = os.read(pipe, 1 << 20)
            if not chunk:  # the child closed the pipe: all it wrote is here
                answered = True
                break
            data += chunk
        timed_out = not answered
    finally:
        os.close(pipe)
        if not answered:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    answer: object = None
    try:
        answer = pickle.loads(data) if answered and data else None
    except Exception:
        answer = None
    one = answer if isinstance(answer, tuple) and len(answer) == 1 else None
    return one, None if timed_out else status


def _can_fork() -> bool:
    # CUDA cannot be used in a forked child once the parent initialized it; a process that
    # has not imported torch (the solver's) has not, and need not import it to know
    torch = sys.modules.get("torch")
    cuda_up = torch is not None and torch.cuda.is_initialized()
    return sys.platform == "linux" and len(os.sched_getaffinity(0)) > 1 and not cuda_up


def _answer(work: Callable[[], T], pipe: int) -> None:
    """In the child: write ``(work(),)`` pickled to ``pipe`` (nothing where it fails) and
    exit at once, leaving the parent's files, buffers and exit handlers alone."""
    try:
        data = pickle.dumps((work(),))
        with os.fdopen(pipe, "wb") as out:
            out.write(data)
    finally:
        os._exit(0)
