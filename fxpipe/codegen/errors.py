"""The code generator's user-facing error."""

__all__ = ["PlanError"]


class PlanError(ValueError):
    """The plan does not fit the traced graph, or the graph calls what a stage cannot."""
