"""What the tracers report besides the graph: the shape each input was traced at and
which of its dimensions may vary, and the error when no tracer captures the model."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["InputShape", "TraceError"]


class TraceError(ValueError):
    """Neither tracer could capture the model."""



@dataclass(frozen=True)
class InputShape:
    """The shape one graph input was traced at, and which of its dimensions may vary.

    ``dynamic[i]`` is the range ``(low, high)`` assumed for dimension i (``high`` None:
    unbounded), or None where the graph holds the traced size as a constant.
    """

    name: str  # the graph placeholder's name
    shape: tuple[int, ...]
    dynamic: tuple[tuple[int, int | None] | None, ...]

