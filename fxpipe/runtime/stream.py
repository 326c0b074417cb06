"""CUDA streams and events that order a pipeline's work without synchronizing.

Every stage runs on its device on its own compute stream; a value that crosses
devices is copied on the destination device's copy stream, ordered by CUDA
events (producer records, copy stream waits, copies non_blocking, records,
consumer waits) and kept alive across streams with ``record_stream``::

    stage p stream ──record──► event ──wait──► copy stream (dev k): y = x.to(k) ──record──► done
                                                                                    │
    stage k stream ◄────────────────────────────wait────────────────────────────────┘

A cross-device copy also runs on the current stream of the source device, hence
a send stream there. Nothing synchronizes the device inside a step; the caller's
current streams wait for the stages at the end of it. On the CPU (no devices)
every method is a no-op or a plain ``.to``.
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["Streams"]


class Streams:
    """The devices of K stages (None: all on the CPU, in order), each stage's compute
    stream and each device's copy and send streams (CUDA only)."""

    def __init__(self, devices: Sequence[torch.device] | None, num_stages: int) -> None:
        self.devices = None if devices is None else list(devices)
        self.compute: list[Any] = [None] * num_stages
        self.copy: dict[torch.device, Any] = {}
        self.send: dict[torch.device, Any] = {}
        for k, dev in enumerate(self.devices or []):
            if dev.type == "cuda":
                self.compute[k] = torch.cuda.Stream(dev)
                if dev not in self.copy:
                    self.copy[dev] = torch.cuda.Stream(dev)
                    self.send[dev] = torch.cuda.Stream(dev)

    def device(self, k: int) -> torch.device | None:
        return None if self.devices is None else self.devices[k]

    def on(self, k: int) -> contextlib.AbstractContextManager[Any]:
        """Run on stage k's compute stream (a no-op on the CPU)."""
        stream = self.compute[k]
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record(self, k: int) -> Any:
        """An event on stage k's stream marking the work issued so far (CUDA only)."""
        stream = self.compute[k]
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, k: int, event: Any) -> None:
        """Stage k's stream waits for ``event`` (None: nothing to wait for)."""
        if event is not None:
            self.compute[k].wait_event(event)

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """Stage streams start after the caller's work and the caller's streams
        continue after the stages' (CUDA only; no device synchronize)."""
        pairs = [(dev, s) for dev, s in zip(self.devices or [], self.compute, strict=False)
                 if s is not None]
        for dev, s in pairs:
            s.wait_stream(torch.cuda.current_stream(dev))
        try:
            yield
        finally:
            for dev, s in pairs:
                torch.cuda.current_stream(dev).wait_stream(s)
                for c in (self.copy[dev], self.send[dev]):
                    torch.cuda.current_stream(dev).wait_stream(c)

    def move(self, x: torch.Tensor, producer: int, k: int, event: Any) -> torch.Tensor:
        """``x``, produced on ``producer``'s stream, made safe to use on stage k's."""
        dev, stream = self.device(k), self.compute[k]
        if dev is None or stream is None:
            if dev is None or x.device == dev:
                return x
            if event is not None and x.device.type == "cuda":  # e.g. to a CPU stage
                torch.cuda.current_stream(x.device).wait_event(event)
            return x.to(dev)
        if x.device == dev:
            if event is not None:
                stream.wait_event(event)
            x.record_stream(stream)
            return x
        y, copied = self.copy_to(x, dev, event, stream)
        stream.wait_event(copied)
        return y

    def copy_to(self, x: torch.Tensor, dev: torch.device, event: Any,
                consumer: Any) -> tuple[torch.Tensor, Any]:
        """Copy ``x`` to ``dev`` on dev's copy stream after ``event``; return the
        copy and the event the ``consumer`` stream must wait for before using it."""
        copy_stream = self.copy[dev]
        src_streams: list[Any] = []
        if x.device.type == "cuda":
            src_streams.append(self._send_stream(x.device))
        with contextlib.ExitStack() as stack:
            for s in [*src_streams, copy_stream]:
                if event is not None:
                    s.wait_event(event)
                stack.enter_context(torch.cuda.stream(s))
            y = x.to(dev, non_blocking=True)
            for s in src_streams:
                x.record_stream(s)
            done = torch.cuda.Event()
            done.record(copy_stream)
        y.record_stream(consumer)
        return y, done

    def send_grads(self, leaf_grads: list[torch.Tensor | None], p: int,
                   done: Any) -> tuple[list[torch.Tensor | None], Any]:
        """Gradients for a value of stage p, computed on another stage after ``done``:
        on p's device, with the event p's stream must wait for before using them."""
        dev_p, stream_p = self.device(p), self.compute[p]
        if dev_p is None or stream_p is None:
            moved = [g if g is None or dev_p is None else g.to(dev_p) for g in leaf_grads]
            return moved, None
        out: list[torch.Tensor | None] = []
        for g in leaf_grads:
            if g is None:
                out.append(None)
            elif g.device == dev_p:
                g.record_stream(stream_p)
                out.append(g)
            else:
                y, copied = self.copy_to(g, dev_p, done, stream_p)
                out.append(y)
                done = copied  # ordered after the backward's event
        return out, done

    def _send_stream(self, dev: torch.device) -> Any:
        if dev not in self.send:
            self.send[dev] = torch.cuda.Stream(dev)
        return self.send[dev]
