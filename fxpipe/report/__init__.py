"""Human-readable outputs of a plan: report.md, report.html, the partition diagram, the
schedule chart."""

from fxpipe.report.diagram import DiagramError, partition_dot, render_svg
from fxpipe.report.html import render_html
from fxpipe.report.markdown import render_report, summary_rows
from fxpipe.report.timeline import schedule_svg

__all__ = [
    "DiagramError",
    "partition_dot",
    "render_html",
    "render_report",
    "render_svg",
    "schedule_svg",
    "summary_rows",
]
