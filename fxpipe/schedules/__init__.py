"""Pipeline schedules: the kinds fxpipe knows, and each as a clock-tick table.

This package owns the schedule kinds. ``KINDS`` holds, per ``ScheduleKind``, its
name (the CLI's ``--schedule`` choices and plan.json's ``schedule``), its tick
table builder, its in-flight rule (micro-batches each stage module holds at its
peak, which the solver's memory model reads), its bubble formula, whether it
stashes weights, whether it interleaves, and the torch.distributed.pipelining
schedule the torchrun pipeline runs it on. A new kind is one ``KINDS`` entry
plus its table builder and its in-flight rule.

A table is a list of clock ticks; each tick is a tuple of the actions that
run concurrently in it, one per device at most. An action is
``(stage, "F" | "B", microbatch)``. The runner executes the ticks in order, so
a table is both the plan and the program.

    kinds.py        ScheduleKind, KINDS (how each kind behaves); a plan's own table is
                    Plan.schedule_table()
    ticks.py        a table: packing per-device orders into ticks, validate, peaks
    flush.py        the tables of the schedules that flush every step: GPipe, 1F1B,
                    interleaved 1F1B
    zero_bubble.py  the tables that split the backward: ZB-H1, ZB-V, DualPipeV
    render.py       a table drawn as text (runner.py's comment, the tests)
"""

from fxpipe.schedules.flush import gpipe, interleaved_1f1b, interleaved_devices, one_f_one_b
from fxpipe.schedules.kinds import KINDS, KindSpec, ScheduleKind, kind_of
from fxpipe.schedules.render import chunk_label, render_ascii
from fxpipe.schedules.ticks import Action, Table, peak_deferred, peak_in_flight, validate
from fxpipe.schedules.zero_bubble import dualpipev, v_devices, zb1p, zbv

__all__ = [
    "KINDS",
    "Action",
    "KindSpec",
    "ScheduleKind",
    "Table",
    "chunk_label",
    "dualpipev",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_devices",
    "kind_of",
    "one_f_one_b",
    "peak_deferred",
    "peak_in_flight",
    "render_ascii",
    "v_devices",
    "validate",
    "zb1p",
    "zbv",
]
