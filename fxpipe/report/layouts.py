"""The cluster's layout in report.md: the layout chosen, the cost model it assumes, and
every layout the search considered, the chosen one first (a TP column where the search
considered tensor parallelism)."""

from __future__ import annotations

from fxpipe.plan import Layout, LayoutRow, Plan
from fxpipe.units import format_bytes, format_ms

__all__ = ["layout_lines", "layout_sentence", "layout_table"]

_STATUS = {
    "chosen": "chosen",
    "solved": "planned",
    "pruned": "its bound is no better",
    "no fit": "no split fits",
    "invalid": "not valid",
    "by hand": "by hand",
}


def layout_sentence(layout: Layout) -> str:
    """One line: "64 GPUs (8 per host) as 8 pipeline stages x 8 data-parallel (fsdp)"."""
    data = (f" x {layout.dp} data-parallel ({layout.dp_mode})" if layout.dp > 1
            else ", one pipeline")
    tensor = f" x {layout.tp} tensor-parallel" if layout.tp > 1 else ""
    return (f"{layout.gpus} GPUs ({layout.gpus_per_node} per host) as {layout.pp} pipeline "
            f"stage{'s' * (layout.pp > 1)}{data}{tensor}")


def layout_lines(plan: Plan) -> list[str]:
    """report.md's "Layout" section (empty for a plan without a layout)."""
    layout = plan.layout
    if layout is None:
        return []
    proved = ("proved the fastest under the cost model below" if layout.proved else
              "the fastest found; not every layout was planned to its optimum")
    lines = [
        "## Layout",
        "",
        f"- {layout_sentence(layout)}: {proved}",
        f"- {layout.global_batch} samples per step: {layout.dp} pipeline"
        f"{'s' * (layout.dp > 1)} of {layout.microbatches} micro-batches of "
        f"{layout.microbatch_size} samples each",
        f"- predicted step {format_ms(layout.step_s)}: the pipeline's "
        f"{format_ms(layout.step_s - layout.sync_s)} and the gradient sync's "
        f"{format_ms(layout.sync_s)}",
        f"- links: stage sends {_link(layout.pipeline_link)}, "
        + (f"gradient syncs {_link(layout.sync_link)}" if layout.dp > 1 else
           "no gradient sync (one pipeline)")
        + f"; ranks on a ({', '.join(layout.mesh)}) mesh, rank = "
        + (f"(pipeline x {layout.pp} + stage) x {layout.tp} + its GPU of the stage"
           if layout.tp > 1 else f"pipeline x {layout.pp} + stage"),
        *_tensor_lines(layout),
        "",
        "The cost model: under fsdp each GPU holds its stage's whole parameters and "
        "gradients during the step (torch's PipelineStage defers FSDP2's reduce-scatter to "
        "the last micro-batch) and 1/d of its optimizer state; ddp holds all of it. After "
        "the pipeline's last backward every stage syncs its gradients over its d copies "
        "(one flat ring all-reduce, or reduce-scatter and all-gather: the same bytes, at "
        "the slowest link the ring crosses; not a hierarchical one, inside hosts first), "
        "not overlapped with the drain; the step ends with the slowest stage's sync. A "
        "stage's sends to the next are in its time, overlapping none of its compute. "
        + _compute(layout),
        "",
        *_tensor_model(layout),
    ]
    columns, rows = layout_table(layout)
    lines += [_row(columns), "|" + "---|" * len(columns), *(_row(row) for row in rows)]
    lines.append("")
    return lines


def _compute(layout: Layout) -> str:
    """The compute efficiency the search assumed, as a sentence."""
    if layout.calibrated:
        return ("Every op takes the time a training step measured (--calibrate), for the "
                "layouts' comparison and the plan alike.")
    return (f"Every op runs at {layout.compute_efficiency:.2f} of the cost model's speed "
            f"(assumed; against the roofline a step on an H100 / H200 measured 0.54-0.63, "
            f"so at 1.00 the collectives look dearer beside the compute than they are; "
            f"--calibrate measures it).")


def _tensor_lines(layout: Layout) -> list[str]:
    """The chosen layout's tensor parallelism: what splits and what stays whole."""
    if layout.tp == 1:
        return []
    vocab = (f", and {', '.join(layout.tp_vocab)} by vocabulary rows" if layout.tp_vocab
             else "")
    whole = ", ".join(layout.tp_replicated) or "none"
    kept = (f"; the rows {', '.join(layout.sp_kept)} keep their all-reduce" if layout.sp_kept
            else "")
    between = (f"on 1/{layout.tp} of the tokens on each GPU (sequence parallelism): "
               f"{layout.sp_ops} ops between the pairs, each row's all-reduce a "
               f"reduce-scatter and an all-gather{kept}; whole on every GPU: the other ops "
               f"between the pairs" if layout.sp_ops else
               "whole on every GPU: the ops between the pairs")
    return [f"- tensor parallelism: each stage's {layout.tp_pairs} column / row-parallel "
            f"pairs (attention by heads, MLPs by hidden width){vocab}, split over {layout.tp} "
            f"GPUs of a host; {between}, and the modules {whole}"]


def _tensor_model(layout: Layout) -> list[str]:
    """The TP cost model, where the search considered tensor parallelism."""
    if all(row.tp == 1 for row in layout.considered):
        return []
    return ["At TP degree t a split op runs 1/t of its FLOPs, parameters and activations; "
            "each pair all-reduces its output over the t GPUs in the forward and its input "
            "gradient in the backward (ring, on the host's link, not overlapped), the "
            "vocabulary-parallel embedding its output in the forward and the LM head its "
            "input gradient in the backward; the ops per token between a row and the next "
            "columns (residual adds, norms, dropout) run on 1/t of the tokens (sequence "
            "parallelism), the row's all-reduce a reduce-scatter and the next columns' input "
            "an all-gather (and so in the backward), the same bytes; the other ops run whole "
            "on every GPU.", ""]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def layout_table(layout: Layout) -> tuple[list[str], list[list[str]]]:
    """The table of the layouts considered, as report.md, report.html and the command
    print it: its column names (a tensor-parallel column where the search considered TP)
    and a row of cells per layout, the chosen one first."""
    tp_column = any(row.tp > 1 for row in layout.considered)
    columns = ["pipeline stages", "data-parallel", *["tensor-parallel"] * tp_column, "mode",
               "micro-batches", "predicted step", "bound", "max memory", "outcome"]
    return columns, [_cells(row, tp_column) for row in _considered(layout)]


def _cells(row: LayoutRow, tp_column: bool = False) -> list[str]:
    """A considered layout's cells, as report.md's table has them: pipeline stages,
    data-parallel, (tensor-parallel,) mode, micro-batches, predicted step, bound, max
    memory, outcome."""
    step = "" if row.step_s is None else format_ms(row.step_s)
    memory = "" if row.max_memory is None else format_bytes(row.max_memory)
    outcome = _STATUS.get(row.status, row.status)
    if row.why:
        outcome += f": {row.why.split('; ')[0].split('. ')[0]}"
    tp = [str(row.tp)] if tp_column else []
    return [str(row.pp), str(row.dp), *tp, row.dp_mode, str(row.microbatches), step,
            format_ms(row.bound_s), memory, outcome]


def _considered(layout: Layout) -> list[LayoutRow]:
    """The layouts the search considered, the chosen one first, then by pipeline degree;
    last, the ones a person would pick by hand, as they would run."""
    return sorted(layout.considered, key=lambda r: (r.status == "by hand", r.status != "chosen",
                                                    r.pp, r.tp, r.dp_mode))


def _link(which: str) -> str:
    return "inside a host (intra-node link)" if which == "intra" else \
        "between hosts (inter-node link)"
