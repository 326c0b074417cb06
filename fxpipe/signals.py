"""Ctrl-C and SIGTERM: stop promptly in any phase, never in the middle of a rename.

    with handle_signals():        # the CLI: SIGINT/SIGTERM raise Interrupted(signum)
        ...                       # a CP-SAT search in progress is stopped too
        with deferred():          # output.py: signals wait until the block ends
            rename(...)

CP-SAT runs its search in C++, where Python's signal handlers cannot run until it
returns (up to --time-limit later); with its own SIGINT catching on it stops, but the
interrupt never reaches Python and afterwards SIGINT is back at the default that kills
the process. So the search does not catch SIGINT (``fxpipe.partition.ilp``) and a
watcher thread, woken through ``signal.set_wakeup_fd``, stops every search in
progress: the handler then runs as soon as the search returns.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["SIGNALS", "Interrupted", "deferred", "handle_signals"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; the process should exit with 128 + the signal number.

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` in a model
    file or a library does not swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextmanager
def handle_signals(on_signal: Callable[[], None] = lambda: None) -> Iterator[None]:
    """SIGINT and SIGTERM raise ``Interrupted`` in the main thread; ``on_signal`` runs in
    a watcher thread the moment one arrives (to stop work that blocks in C++)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise) for signum in SIGNALS}
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        while os.read(read, 1):  # b"" once the write end is closed
            on_signal()

    watcher = threading.Thread(target=watch, name="fxpipe-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        os.close(write)
        watcher.join()
        os.close(read)
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextmanager
def deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block are delivered when it ends, to the
    handlers that were in place (``Interrupted``, Python's KeyboardInterrupt, or the
    default that ends the process). Keeps a sequence of renames whole."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {signum: signal.signal(signum, lambda s, _f: pending.append(s))
                for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for held in dict.fromkeys(pending):
            signal.raise_signal(held)
