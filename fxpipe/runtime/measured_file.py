"""``measured.json``: the file a measurement is saved as, the plan it measured, and the one
check every reader and writer of it goes through.

``Measurement.save`` (measure.py) writes it, ``load_measured`` reads it back; both refuse a
value no training step can measure (a NaN, an infinite, negative or zero time, no step)
in one line naming the file, the field and the value, so that neither ``fxpipe report``
nor ``fxpipe split --calibrate`` ever compares a plan with one.

A measurement names the plan it measured (``"plan": {"model": ..., "fingerprint": ...}``):
``plan_identity`` of the package's plan.json, a digest of what decides the program that
ran (the model, the schedule, the micro-batches, the precision, and each stage's nodes,
recompute and replicas), not of the predicted costs, which a re-plan may change without
changing a stage. A file written before measurements named their plan has ``"plan"``
absent or null.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "VERSION", "Measured", "PlanIdentity", "StageMeasure", "check_measured",
           "load_measured", "package_plan", "plan_identity"]

FORMAT = "fxpipe-measured"
VERSION = 1
REMEASURE = ("measure again (runner.measure(...) and card.save, or train_torchrun.py "
             "--measure)")
# plan.json's keys that decide the program a package runs, at the top and per stage
_PLAN_KEYS = ("model", "schedule", "microbatches", "virtual_stages", "precision")
_STAGE_KEYS = ("index", "nodes", "recompute", "keeps", "replicas")


@dataclass(frozen=True)
class StageMeasure:
    """One stage's measured seconds per micro-batch, and its device's peak bytes."""

    index: int
    forward_s: float
    backward_s: float
    comm_s: float
    peak_memory_bytes: int | None = None
    device: str = "cpu"

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.comm_s


@dataclass(frozen=True)
class PlanIdentity:
    """The plan a measurement measured: its model and ``plan_identity``'s fingerprint."""

    model: str
    fingerprint: str

    def __str__(self) -> str:
        return f"{self.model or 'a plan'} (plan {self.fingerprint})"


@dataclass(frozen=True)
class Measured:
    """A ``measured.json`` as read back."""

    device: str
    clock: str
    microbatches: int
    steps: int
    step_s: float
    stages: tuple[StageMeasure, ...]
    serial: bool = False  # stages sharing a GPU ran one after another on one stream
    plan: PlanIdentity | None = None  # None: written before measurements named their plan

    @property
    def shared(self) -> dict[str, tuple[int, ...]]:
        """Each device that several stages were measured on, with those stages: its peak
        is theirs together, not any one stage's."""
        stages: dict[str, list[int]] = {}
        for stage in self.stages:
            stages.setdefault(stage.device, []).append(stage.index)
        return {device: tuple(ks) for device, ks in stages.items() if len(ks) > 1}

    @property
    def overlapped(self) -> dict[str, tuple[int, ...]]:
        """The shared GPUs whose stages ran side by side on streams of their own, so that
        each stage's times include its neighbours' kernels."""
        if self.serial:
            return {}
        return {d: ks for d, ks in self.shared.items() if d.startswith("cuda")}


def plan_identity(plan: Mapping[str, Any]) -> PlanIdentity:
    """The identity of plan.json's ``plan`` (as a dict): its model, and a digest of what
    decides the program its package runs."""
    decides = {key: plan.get(key) for key in _PLAN_KEYS}
    decides["stages"] = [{key: stage.get(key) for key in _STAGE_KEYS}
                         for stage in plan.get("stages", ())]
    text = json.dumps(decides, sort_keys=True, separators=(",", ":"))
    return PlanIdentity(str(plan.get("model") or ""),
                        hashlib.sha256(text.encode("utf-8")).hexdigest()[:16])


def package_plan() -> PlanIdentity | None:
    """The identity of the plan.json beside this runtime: a generated package carries the
    runtime as its ``runtime/`` folder, next to its plan.json. None outside a package."""
    path = Path(__file__).resolve().parents[1] / "plan.json"
    if not path.is_file():
        return None
    return plan_identity(json.loads(path.read_text(encoding="utf-8")))


def load_measured(path: str | Path) -> Measured:
    """Read and check a ``measured.json``; a ValueError names what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; write one with runner.measure(...) and "
                         f"card.save(path)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc}); pass the file card.save wrote") from None
    return check_measured(data, path)


def check_measured(data: Any, path: str | Path) -> Measured:
    """``data``, a measured.json as parsed, checked: the one check of every value, for
    the file at ``path`` (named in the errors)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not an fxpipe measurement (no \"format\": \"{FORMAT}\"); "
                         f"pass the file card.save wrote")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: measurement version {data.get('version')!r}, this fxpipe "
                         f"reads version {VERSION}; measure again with this fxpipe's runtime")
    try:
        raw_stages = data["stages"]
        if not isinstance(raw_stages, list) or not all(isinstance(s, dict) for s in raw_stages):
            raise TypeError(f"stages is {raw_stages!r}, not a list of objects")
        stages = tuple(_stage(s, k, path) for k, s in enumerate(raw_stages))
        plan = data.get("plan")
        measured = Measured(
            str(data["device"]), str(data["clock"]),
            _whole(data["microbatches"], "microbatches", 1, path),
            _whole(data["steps"], "steps", 1, path),
            _seconds(data["step_s"], "step_s", path, zero=False), stages,
            bool(data.get("serial", False)),
            None if plan is None else PlanIdentity(str(plan["model"]), str(plan["fingerprint"])),
        )
        _whole(data.get("warmup_steps", 0), "warmup_steps", 0, path)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: a field is missing or malformed ({exc!r}); pass the file "
                         f"card.save wrote") from None
    if [s.index for s in stages] != list(range(len(stages))) or not stages:
        raise ValueError(f"{path}: stages must be listed 0, 1, ... in order, got "
                         f"{[s.index for s in stages]}")
    return measured


def _stage(raw: dict[str, Any], k: int, path: str | Path) -> StageMeasure:
    """Stage ``k`` of the file (its k-th entry), every figure checked."""
    index = _whole(raw["index"], f"stage {k}'s index", 0, path)
    field = f"stage {index}'s"
    peak = raw.get("peak_memory_bytes")
    return StageMeasure(
        index,
        _seconds(raw["forward_s"], f"{field} forward_s", path, zero=False),
        _seconds(raw["backward_s"], f"{field} backward_s", path, zero=False),
        _seconds(raw["comm_s"], f"{field} comm_s", path, zero=True),  # one stage sends nothing
        None if peak is None else _whole(peak, f"{field} peak_memory_bytes", 1, path),
        str(raw.get("device", "cpu")),
    )


def _seconds(value: Any, field: str, path: str | Path, *, zero: bool) -> float:
    """A measured time: a finite number, positive (or 0 where ``zero``)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        kind = "0 or more" if zero else "more than 0"
        raise ValueError(f"{path}: {field} is {value!r}, which no step measures (a measured "
                         f"time is a finite number of seconds, {kind}); {REMEASURE}")
    return float(value)


def _whole(value: Any, field: str, least: int, path: str | Path) -> int:
    """A count: a whole number, ``least`` or more."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{path}: {field} is {value!r}, which no step measures (it is a "
                         f"whole number, {least} or more); {REMEASURE}")
    return value
