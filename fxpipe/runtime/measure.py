"""A plan measured: what each stage really costs in a training step.

    with runner.measure(warmup=1) as card:
        for batch, target in data:
            runner.step(batch, target, loss_fn)
    card.save("fxpipe-out/measured.json")

For every step after the first ``warmup`` ones the runner times, per stage, its
forwards, its backwards and its sends and receives (CUDA events on the stage's stream on
a GPU, ``time.perf_counter`` on the CPU), and the step itself. Stages that share a GPU
overlap on their streams; ``runner.measure(serial=True)`` runs them one after another
while measuring, so that each is timed alone. A forward or backward span
excludes the receives and sends nested in it, which count as communication. On CUDA the
step synchronizes once at its end, and only while measuring, to read the events.

``measured.json`` (``FORMAT``, ``VERSION``; measured_file.py reads and checks it), every
time in seconds:

    {"format": "fxpipe-measured", "version": 1,
     "plan": {"model": "<plan.json's model>", "fingerprint": "<16 hex digits>"} | null,
     "device": "cpu" | "<CUDA device name>", "clock": "wall" | "cuda-events",
     "serial": false (true: stages sharing a GPU ran on one stream while measured),
     "microbatches": M, "warmup_steps": 1, "steps": N (steps measured),
     "step_s": median wall time of a step,
     "stages": [{"index": k, "forward_s": ..., "backward_s": ..., "comm_s": ...,
                 "peak_memory_bytes": int | null, "device": "cpu" | "cuda:0"}, ...]}

A stage's ``forward_s``, ``backward_s`` and ``comm_s`` are per micro-batch, like a plan's:
the step's total for the stage divided by M, the median over the measured steps. A
recomputed stage's backward includes its recomputed forward. ``peak_memory_bytes`` is
``torch.cuda.max_memory_allocated`` of the stage's device over the measured steps (stages
sharing a device share the figure); null on the CPU. Under torchrun a stage's ``device``
carries its rank (``"cuda:0 on rank 1"``, rank_measure.py): stages of different
processes never share one. ``plan`` names the plan measured: the plan.json of the package
whose runtime measured (``measured_file.plan_identity``); null for a runtime used outside a
generated package.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .measured_file import FORMAT, VERSION, PlanIdentity, StageMeasure, check_measured, package_plan

__all__ = [
    "MeasuredSteps",
    "Measurement",
    "Recorder",
    "timed",
]

SPANS = ("forward", "backward", "comm")


class Measurement:
    """Measured steps of one runner; filled while ``PipelineRunner.measure`` is active,
    and written as ``measured.json`` by ``save`` (read back as measured_file's ``Measured``)."""

    def __init__(self, num_stages: int, microbatches: int, *, warmup: int = 1,
                 device: str = "cpu", clock: str = "wall") -> None:
        if warmup < 0:
            raise ValueError(f"warmup must be 0 or more steps, got {warmup}")
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.warmup = warmup
        self.device = device
        self.clock = clock
        self.seen = 0  # steps run, warm-up included
        # per measured step: per stage, per kind, total seconds of the step
        self.totals: list[list[dict[str, float]]] = []
        self.step_times: list[float] = []
        self.peak_memory: list[int | None] = [None] * num_stages
        self.stage_devices: list[str] = ["cpu"] * num_stages
        self.serial = False  # stages sharing a GPU ran on one stream (measure(serial=True))
        self.plan: PlanIdentity | None = None  # the plan measured; None: not known

    @property
    def steps(self) -> int:
        return len(self.step_times)

    def add_step(self, totals: list[dict[str, float]], step_s: float) -> None:
        assert len(totals) == self.num_stages, (len(totals), self.num_stages)
        self.totals.append(totals)
        self.step_times.append(step_s)

    def stages(self) -> list[StageMeasure]:
        if not self.totals:
            raise ValueError(
                f"no step was measured ({self.seen} run, {self.warmup} of warm-up); run more "
                f"steps inside runner.measure(...) or lower warmup"
            )
        M = self.microbatches

        def median(k: int, kind: str) -> float:
            return statistics.median(step[k][kind] for step in self.totals) / M

        return [StageMeasure(k, median(k, "forward"), median(k, "backward"), median(k, "comm"),
                             self.peak_memory[k], self.stage_devices[k])
                for k in range(self.num_stages)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "plan": None if self.plan is None else asdict(self.plan),
            "device": self.device,
            "clock": self.clock,
            "serial": self.serial,
            "microbatches": self.microbatches,
            "warmup_steps": self.warmup,
            "steps": self.steps,
            "step_s": statistics.median(self.step_times) if self.step_times else 0.0,
            "stages": [
                {"index": s.index, "forward_s": s.forward_s, "backward_s": s.backward_s,
                 "comm_s": s.comm_s, "peak_memory_bytes": s.peak_memory_bytes,
                 "device": s.device}
                for s in self.stages()
            ],
        }

    def save(self, path: str | Path) -> Path:
        """Write ``measured.json`` (see the module docstring) to ``path``; a ValueError,
        and nothing written, where a figure is one no step measures (a clock that failed)."""
        path = Path(path)
        data = self.to_dict()
        check_measured(data, path)  # the check fxpipe report makes of it
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path


class Recorder:
    """Times the spans of the runner's steps into its ``card``; ``devices``: one per stage
    (None: the CPU), ``streams``: stage -> its CUDA compute stream (None on the CPU)."""

    def __init__(self, num_stages: int, microbatches: int, warmup: int,
                 devices: Sequence[torch.device] | None,
                 streams: Callable[[int], Any]) -> None:
        first = devices[0] if devices else None
        on_cuda = first is not None and first.type == "cuda"
        self.card = Measurement(num_stages, microbatches, warmup=warmup,
                               device=torch.cuda.get_device_name(first) if on_cuda else "cpu",
                               clock="cuda-events" if on_cuda else "wall")
        self.stream_of = streams
        self.cuda = sorted({d for d in devices or [] if d.type == "cuda"}, key=str)
        self.devices = devices
        self.active = False
        self.start = 0.0
        # (stage, kind, start, end) of this step's spans; kind "-forward" / "-backward" is
        # a comm span nested in one, to take off it
        self.spans: list[tuple[int, str, Any, Any]] = []
        self.open: list[tuple[int, str]] = []  # forward / backward spans open, innermost last

    def _now(self, k: int) -> Any:
        stream = self.stream_of(k)
        if stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.active = self.card.seen >= self.card.warmup
        if self.active and self.card.steps == 0:
            for dev in self.cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
        self.spans = []
        self.start = time.perf_counter()
        try:
            yield
        finally:
            self.card.seen += 1
            measured, self.active = self.active, False  # forward() between steps: untimed
        if not measured:
            return
        for dev in self.cuda:
            torch.cuda.synchronize(dev)
        step_s = time.perf_counter() - self.start
        totals = [dict.fromkeys(SPANS, 0.0) for _ in range(self.card.num_stages)]
        for k, kind, start, end in self.spans:  # "-forward": comm nested in a forward
            sign = -1.0 if kind.startswith("-") else 1.0
            totals[k][kind.lstrip("-")] += sign * _elapsed(start, end)
        for t in totals:
            for kind in SPANS:
                t[kind] = max(0.0, t[kind])
        self.card.add_step(totals, step_s)
        for k, dev in enumerate(self.devices or []):
            self.card.stage_devices[k] = str(dev)
            if dev.type == "cuda":
                self.card.peak_memory[k] = int(torch.cuda.max_memory_allocated(dev))

    @contextlib.contextmanager
    def span(self, k: int, kind: str) -> Iterator[None]:
        """Time ``kind`` ("forward", "backward" or "comm") of stage k; a comm span inside
        stage k's open forward or backward is taken off that span."""
        if not self.active:
            yield
            return
        start = self._now(k)
        yield
        end = self._now(k)
        self.spans.append((k, kind, start, end))
        if kind == "comm":
            outer = next((o for o in reversed(self.open) if o[0] == k), None)
            if outer is not None:
                self.spans.append((k, "-" + outer[1], start, end))

    @contextlib.contextmanager
    def compute(self, k: int, kind: str) -> Iterator[None]:
        """A forward or backward span of stage k, which comm spans can nest in."""
        self.open.append((k, kind))
        try:
            with self.span(k, kind):
                yield
        finally:
            self.open.pop()


class MeasuredSteps:
    """``PipelineRunner.measure``: the runner's steps timed into a ``Measurement``."""

    stages: Sequence[Any]
    microbatches: int
    devices: list[torch.device] | None
    streams: Any
    _recorder: Recorder | None = None  # while measure() is active

    @contextlib.contextmanager
    def measure(self, *, warmup: int = 1, serial: bool = False) -> Iterator[Measurement]:
        """Time every ``step`` run inside, after the first ``warmup``: each stage's
        forward, backward and communication, its device's peak memory and the step;
        ``card.save(path)`` writes them as ``measured.json``.

        Stages that share a GPU run side by side on streams of their own, so each one's
        times include its neighbours' kernels (measured on one H100: 2-4x a stage's time
        alone). ``serial`` runs them on one stream per GPU while measuring, so each
        stage is timed alone, as on a GPU of its own: the times to calibrate a plan
        from. The results are the same either way."""
        compute = list(self.streams.compute)
        if serial:
            self.streams.compute = one_stream_per_device(compute, self.devices)
        self._recorder = Recorder(len(self.stages), self.microbatches, warmup, self.devices,
                                  lambda k: self.streams.compute[k])
        self._recorder.card.serial = serial
        self._recorder.card.plan = package_plan()
        try:
            yield self._recorder.card
        finally:
            self._recorder = None
            self.streams.compute = compute


def one_stream_per_device(compute: Sequence[Any],
                          devices: Sequence[torch.device] | None) -> list[Any]:
    """Each stage's compute stream replaced by the first one on its device (None: the
    CPU, where stages run in order anyway)."""
    if devices is None:
        return list(compute)
    first: dict[torch.device, Any] = {}
    return [stream if stream is None else first.setdefault(dev, stream)
            for stream, dev in zip(compute, devices, strict=True)]


def timed(recorder: Recorder | None, k: int | None = None,
          kind: str = "") -> contextlib.AbstractContextManager[None]:
    """While measuring (``recorder`` not None): a whole step (``k`` None), or a span of
    stage k's ``kind`` ("F" or "forward"; "B", "I", "W" or "backward"; "comm"); otherwise
    nothing."""
    if recorder is None:
        return contextlib.nullcontext()
    if k is None:
        return recorder.step()
    if kind == "comm":
        return recorder.span(k, kind)
    return recorder.compute(k, "forward" if kind in ("F", "forward") else "backward")


def _elapsed(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return float(end - start)
    return float(start.elapsed_time(end)) / 1000.0  # CUDA events give milliseconds
