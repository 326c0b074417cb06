"""Human-readable outputs of a plan: report.md and the partition diagram."""

from fxpipe.report.diagram import partition_dot, render_svg
from fxpipe.report.markdown import render_report, summary_rows

__all__ = ["partition_dot", "render_report", "render_svg", "summary_rows"]
