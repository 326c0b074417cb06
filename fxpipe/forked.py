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
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["FORK_MIN_NODES", "Forked"]

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
        if not (in_child and _can_fork()):
            return
        read, write = os.pipe()
        try:
            pid = os.fork()
        except OSError:  # no memory or process slot for a child: the work is done when asked
            os.close(read)
            os.close(write)
            return
        if pid == 0:  # the child: answer through the pipe, then leave without cleanup
            os.close(read)
            _answer(work, write)
        os.close(write)
        self._pid, self._pipe = pid, read

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
        data = bytearray()
        deadline = time.monotonic() + WAIT_S
        answered = False
        try:
            while (left := deadline - time.monotonic()) > 0:
                if not select.select([self._pipe], [], [], left)[0]:
                    break
                chunk = os.read(self._pipe, 1 << 20)
                if not chunk:  # the child closed the pipe: all it wrote is here
                    answered = True
                    break
                data += chunk
        finally:
            os.close(self._pipe)
            if not answered:
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        try:
            answer = pickle.loads(data) if answered and data else None
        except Exception:
            return None
        return answer if isinstance(answer, tuple) and len(answer) == 1 else None


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
