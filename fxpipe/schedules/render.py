"""A tick table drawn as text: a row per stage (or per GPU), a column per tick. runner.py
carries the picture of its schedule above the table; the tests draw the papers' figures."""

from __future__ import annotations

from collections.abc import Sequence

from fxpipe.schedules.ticks import Action, device_list

__all__ = ["chunk_label", "render_ascii"]


def chunk_label(c: int) -> str:
    """Chunk 0, 1, ..., 25, 26, ... as a, b, ..., z, aa, ... (spreadsheet columns)."""
    label = ""
    c += 1
    while c:
        c, rest = divmod(c - 1, 26)
        label = chr(ord("a") + rest) + label
    return label


def render_ascii(
    schedule: Sequence[Sequence[Action]],
    num_stages: int,
    *,
    width: int | None = None,
    devices: Sequence[int] | None = None,
) -> str:
    """Rows are stages, columns are ticks; ``..`` marks an idle stage (a bubble).

    With ``devices`` (``devices[j]``: stage j's device, several stages to a device as
    in interleaved 1F1B), rows are devices, ``gpu d``, and each cell names the chunk
    after the micro-batch: ``F3b`` is the forward of micro-batch 3 on the device's
    second stage (chunks a, b, ... in stage order). With ``width``, a schedule wider
    than that is drawn as several blocks of ticks, one under the other, each headed
    by the tick it starts at.
    """
    if devices is None:
        row_of = list(range(num_stages))
        rows = [f"stage {j}" for j in row_of]
        suffix = [""] * num_stages
    else:
        row_of = device_list(devices, num_stages)
        rows = [f"gpu {d}" for d in range(max(row_of, default=-1) + 1)]
        chunk_of = [sum(1 for i in range(j) if row_of[i] == row_of[j]) for j in range(num_stages)]
        suffix = [chunk_label(c) for c in chunk_of]
    cell = max([2] + [len(f"{kind}{m}{suffix[j]}") for tick in schedule for j, kind, m in tick])
    grid = [["." * cell] * len(schedule) for _ in rows]
    for t, tick in enumerate(schedule):
        for j, kind, m in tick:
            grid[row_of[j]][t] = f"{kind}{m}{suffix[j]}".ljust(cell)
    label = max((len(r) for r in rows), default=0)
    per_block = len(schedule) or 1
    if width is not None:
        per_block = max(1, (width - label - 3 + 1) // (cell + 1))
    blocks = []
    for start in range(0, max(len(schedule), 1), per_block):
        lines = [
            f"{name.ljust(label)} | " + " ".join(row[start : start + per_block]).rstrip()
            for name, row in zip(rows, grid, strict=True)
        ]
        if per_block < len(schedule):
            lines.insert(0, f"{'tick'.ljust(label)} | {start}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
