"""What a split is asked, checked: the options of ``fxpipe split`` and of ``fxpipe.split``
read and checked together, before any slow work, into ``SplitOptions``.

Both front doors call ``split_options``; only the wording differs. A message names an
option as its caller spells it (``Spelling``): ``--virtual-stages 2`` on the command line,
``virtual_stages=2`` in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Required, TypedDict

from fxpipe.partition.layout import DP_MODES, ddp_copies, fills_hosts, per_host
from fxpipe.schedules import KINDS, ScheduleKind

if TYPE_CHECKING:
    from fxpipe.options import ClusterOptions, SplitOptions
    from fxpipe.partition import Recompute
    from fxpipe.plan import Plan
    from fxpipe.report.card import ReportCard

__all__ = ["API", "CLI", "MAX_MICROBATCHES", "Spelling", "SplitKeywords", "read_card",
           "read_plan", "recompute_of", "split_options"]

# the most micro-batches one pipeline runs a step (under a layout, each pipeline runs its
# share): runner.py lists every action of the schedule (2 x M x K): 10,000 micro-batches on
# 4 GPUs took 7 minutes (schedule.svg, which drew them all then, draws a bounded part since).
MAX_MICROBATCHES = 1024
OPTIMIZERS = ("adam", "sgd", "sgd-momentum")


@dataclass(frozen=True)
class Spelling:
    """How messages name an option: as a flag (``--virtual-stages``) or a keyword."""

    command_line: bool

    def name(self, option: str) -> str:
        """``virtual_stages`` as its caller writes it: ``--virtual-stages`` or itself."""
        return f"--{option.replace('_', '-')}" if self.command_line else option

    def said(self, option: str, value: object) -> str:
        """The option given ``value``: ``--schedule zbv`` or ``schedule='zbv'``."""
        if self.command_line:
            return f"{self.name(option)} {value}"
        return f"{option}={value!r}"


CLI = Spelling(command_line=True)
API = Spelling(command_line=False)



class SplitKeywords(TypedDict, total=False):
    """The options ``fxpipe.split`` and ``fxpipe.split_file`` take as keywords and hand to
    ``split_options``, which gives each its default and checks it."""

    gpus: Required[int]
    memory: str | float | None
    device: str
    microbatches: int | None
    schedule: str | None
    virtual_stages: int
    replicate: bool
    optimizer: str
    recompute: str
    time_limit: float
    work_limit: float
    precision: str | None
    pp: int | str | None
    gpus_per_node: int | None
    dp_mode: str | None
    global_batch: int | None
    tp: int | str | None


def split_options(
    *,
    gpus: int,
    memory: str | float | None = None,
    device: str = "h100",
    microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int = 1,
    replicate: bool = False,
    optimizer: str = "adam",
    recompute: str = "auto",
    time_limit: float = 120.0,
    work_limit: float = 10.0,
    precision: str | None = None,
    pp: int | str | None = None,
    gpus_per_node: int | None = None,
    dp_mode: str | None = None,
    global_batch: int | None = None,
    tp: int | str | None = None,
    spelling: Spelling = CLI,
) -> SplitOptions:
    """Every option checked, alone and together, into the driver's ``SplitOptions``; a
    mistake is one ``ValueError`` naming the option as ``spelling`` writes it. ``memory``:
    bytes, or a size such as ``"80GiB"`` (default: the device's)."""
    from fxpipe.cost_models import get_device
    from fxpipe.options import SplitOptions
    from fxpipe.precision import parse_precision
    from fxpipe.units import parse_bytes

    say = spelling
    if gpus < 1:
        raise ValueError(f"{say.name('gpus')} must be at least 1, got {gpus}")
    count = microbatches if microbatches is not None else 4 * gpus
    if count < 1:
        raise ValueError(f"{say.name('microbatches')} must be at least 1, got {count}")
    cluster = _cluster(pp, gpus_per_node, dp_mode, global_batch, tp, replicate=replicate,
                       gpus=gpus, say=say)
    if cluster is not None and global_batch is not None and microbatches is not None:
        cluster = replace(cluster, microbatches=microbatches)  # checked once b is known
    # a layout's pipelines share the step's micro-batches: known here where --pp is given
    # (the search checks its own layouts' shares)
    width = None if cluster is None else cluster.pp and cluster.pp * (cluster.tp or 1)
    shares = 1 if cluster is None else gpus // width if width and gpus % width == 0 else None
    if shares is not None and count // shares > MAX_MICROBATCHES:
        given = (f"{say.said('microbatches', count)} is" if microbatches is not None else
                 f"{say.said('gpus', gpus)} means {count} micro-batches (the default, 4 x "
                 f"{say.name('gpus')}),")
        each = "" if shares == 1 else f" {count // shares} to each of {shares} pipelines,"
        raise ValueError(
            f"{given}{each} more than {MAX_MICROBATCHES}: runner.py lists every forward and "
            f"backward of every micro-batch; use "
            f"{say.said('microbatches', MAX_MICROBATCHES * shares)} "
            "or fewer (bigger micro-batches)")
    if not math.isfinite(time_limit) or time_limit <= 0:  # nan <= 0 is False
        raise ValueError(
            f"{say.name('time_limit')} must be a positive number of seconds, got {time_limit}")
    if not math.isfinite(work_limit) or work_limit <= 0:
        raise ValueError(f"{say.name('work_limit')} must be a positive number, got {work_limit}")
    _one_of(optimizer, OPTIMIZERS, "optimizer", say)
    kind, virtual_stages = _schedule(schedule, virtual_stages, replicate=replicate, gpus=gpus,
                                     microbatches=count, say=say)
    cluster = _one_process(cluster, kind, gpus=gpus, say=say)
    chosen = recompute_of(recompute, say)
    parsed = parse_precision(precision) if precision is not None else None
    target = get_device(device)
    limit = (float(target.memory_bytes) if memory is None
             else float(memory) if isinstance(memory, (int, float)) else float(parse_bytes(memory)))
    return SplitOptions(
        gpus=gpus,
        device=target,
        memory_limit=limit,
        microbatches=count,
        schedule=kind,
        optimizer=optimizer,
        recompute=chosen,
        time_limit_s=time_limit,
        work_limit=work_limit,
        virtual_stages=virtual_stages,
        replicate=replicate,
        precision=parsed,
        cluster=cluster,
    )


def _one_of(value: object, choices: tuple[str, ...], option: str, say: Spelling) -> None:
    """Refuse a value outside ``choices`` (argparse refuses it first on the command line)."""
    if value not in choices:
        raise ValueError(f"{say.name(option)} takes one of {', '.join(choices)}, got {value!r}")


def _schedule(schedule: str | None, v: int, *, replicate: bool, gpus: int,
              microbatches: int, say: Spelling) -> tuple[ScheduleKind, int]:
    """The schedule kind and its stage modules per GPU, from the schedule, the virtual
    stages and replication, checked together."""
    if v < 1:
        raise ValueError(f"{say.name('virtual_stages')} must be at least 1, got {v}")
    if schedule is not None:
        _one_of(schedule, tuple(kind.value for kind in KINDS), "schedule", say)
        kind = ScheduleKind(schedule)
    else:
        kind = ScheduleKind.INTERLEAVED if v > 1 else ScheduleKind.ONE_F_ONE_B
    name = kind.value
    if kind.spec.splits_backward and replicate:
        # the runner's split backward runs unreplicated stages only
        raise ValueError(f"{say.name('replicate')} and {say.said('schedule', name)} cannot be "
                         "combined; pick one")
    if kind.spec.v_placed:
        if v not in (1, 2):
            raise ValueError(f"{say.said('schedule', name)} places 2 stage modules per GPU; "
                             f"drop {say.said('virtual_stages', v)}")
        if kind is ScheduleKind.DUALPIPEV and microbatches < 2 * gpus:
            raise ValueError(f"{say.said('schedule', name)} needs at least 2 x "
                             f"{say.name('gpus')} micro-batches ({2 * gpus}); use "
                             f"{say.said('microbatches', 2 * gpus)}")
        return kind, 2
    if kind.spec.interleaved and v == 1:
        raise ValueError(f"{say.said('schedule', name)} needs "
                         f"{say.said('virtual_stages', 2)} or more")
    if v > 1 and not kind.spec.interleaved:
        raise ValueError(f"{say.said('virtual_stages', v)} needs "
                         f"{say.said('schedule', 'interleaved')}, not {name}")
    if v > 1 and replicate:
        raise ValueError(f"{say.name('replicate')} and {say.name('virtual_stages')} cannot be "
                         "combined; pick one")
    if v > 1 and microbatches % gpus:
        fix = -(-microbatches // gpus) * gpus
        raise ValueError(
            f"{say.said('schedule', 'interleaved')} needs the micro-batches ({microbatches}) "
            f"to be a multiple of {say.name('gpus')} ({gpus}); use "
            f"{say.said('microbatches', fix)}")
    return kind, v


def recompute_of(value: str, say: Spelling = CLI) -> Recompute:
    """The recompute policy named ``value`` (a bare --recompute means full; ``all``, its
    word before, is read as full: ``Recompute``)."""
    from fxpipe.partition import Recompute

    try:
        return Recompute(value)
    except ValueError:
        names = ", ".join(r.value for r in Recompute)
        bare = f" (a bare {say.name('recompute')} means full)" if say.command_line else ""
        raise ValueError(
            f"{say.name('recompute')} takes one of {names}, got {value!r}{bare}") from None


def _cluster(pp: int | str | None, gpus_per_node: int | None, dp_mode: str | None,
             global_batch: int | None, tp: int | str | None, *, replicate: bool,
             gpus: int, say: Spelling) -> ClusterOptions | None:
    """The cluster search's options: with none of them given, the search chooses every
    part of the layout; None only under ``replicate`` (PipeDream's uneven replication
    plans one pipeline on all the GPUs, its stages replicated as the solver chooses).
    ``tp``: None or 1, no tensor parallelism; "auto", the search chooses the degree."""
    from fxpipe.options import ClusterOptions

    if (pp, gpus_per_node, dp_mode, global_batch, tp) == (None,) * 5 and replicate:
        return None
    per_pipeline = None if pp in (None, "auto") else _whole(pp, "pp", say)
    per_stage = None if tp == "auto" else 1 if tp is None else _whole(tp, "tp", say)
    if per_stage is not None and per_stage < 1:
        raise ValueError(f"{say.name('tp')} must be auto or at least 1, got {per_stage}")
    if replicate:  # a layout's stages run v to a GPU (interleaved, a V) as one pipeline's do
        cluster = ", ".join(say.name(o) for o in ("pp", "gpus_per_node", "dp_mode"))
        raise ValueError(f"{say.name('replicate')} plans one pipeline on all the GPUs: leave "
                         f"out {cluster} and {say.name('global_batch')} with it")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ValueError(f"{say.name('gpus_per_node')} must be at least 1, got {gpus_per_node}")
    host = per_host(gpus, gpus_per_node)
    if not fills_hosts(gpus, host):
        given = ("" if gpus_per_node is not None else
                 f" (the default {say.name('gpus_per_node')})")
        raise ValueError(
            f"{say.said('gpus', gpus)} does not fill hosts of {host} GPUs{given}: use a "
            f"multiple of {host}, or give the GPUs of a host with "
            f"{say.name('gpus_per_node')} ({say.said('gpus_per_node', gpus)} for one host)")
    if dp_mode is not None:
        _one_of(dp_mode, DP_MODES, "dp_mode", say)
    _degrees_fit(per_pipeline, per_stage, gpus=gpus, host=host, say=say)
    if (dp_mode is not None and per_pipeline is not None and per_stage is not None
            and not ddp_copies(dp_mode, gpus // (per_pipeline * per_stage), per_stage)):
        raise ValueError(
            f"{say.said('dp_mode', 'ddp')} cannot keep copies of stages split over GPUs "
            f"({say.said('tp', per_stage)}): torch's DDP takes no DTensor parameters; use "
            f"{say.said('dp_mode', 'fsdp')}, or {say.said('pp', gpus // per_stage)} for one "
            f"pipeline of all the GPUs")
    return ClusterOptions(gpus_per_node=gpus_per_node, pp=per_pipeline, dp_mode=dp_mode,
                          global_batch=global_batch, tp=per_stage)


def _one_process(cluster: ClusterOptions | None, kind: ScheduleKind, *, gpus: int,
                 say: Spelling) -> ClusterOptions | None:
    """A schedule torch.distributed.pipelining has no class for (PipeDream's weight
    stashing) runs in runner.py's one process only: one pipeline on all the GPUs, no
    data-parallel copies to keep equal or stages split over GPUs, which need torchrun."""
    if cluster is None or kind.spec.torch_class is not None:
        return cluster
    if cluster.pp not in (None, gpus) or cluster.tp not in (None, 1):
        raise ValueError(
            f"{say.said('schedule', kind.value)} runs in one process (runner.py), as one "
            f"pipeline on all the GPUs: leave out {say.name('pp')} and {say.name('tp')} with "
            f"it, or use another {say.name('schedule')} (1f1b) for a layout")
    return replace(cluster, pp=gpus, tp=1)


def _degrees_fit(pp: int | None, tp: int | None, *, gpus: int, host: int,
                 say: Spelling) -> None:
    """Refuse, before tracing, a pinned pipeline degree that does not divide the GPUs and a
    pinned TP degree that does not divide a host's (a stage's GPUs share a host)."""
    if pp is not None and (pp < 1 or gpus % pp):
        raise ValueError(f"{say.said('pp', pp)} does not divide {say.said('gpus', gpus)}: use "
                         f"one of {', '.join(map(str, _divisors(gpus)))}")
    if tp is not None and host % tp:
        raise ValueError(f"{say.said('tp', tp)} does not divide {say.said('gpus_per_node', host)}"
                         f" (a stage's GPUs share a host): use one of "
                         f"{', '.join(map(str, _divisors(host)))}")
    if pp is not None and tp is not None and gpus % (pp * tp):
        raise ValueError(f"{say.said('pp', pp)} x {say.said('tp', tp)} GPUs per pipeline do "
                         f"not divide {say.said('gpus', gpus)}: use a smaller "
                         f"{say.name('pp')} or {say.name('tp')}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _whole(value: Any, option: str, say: Spelling) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{say.name(option)} takes auto or a number, got {value!r}") from None


def read_plan(folder: Path, which: str) -> Plan:
    """The Plan in ``folder``/plan.json; ``which`` says what the folder should hold."""
    from fxpipe.plan import Plan

    plan_file = Path(folder) / "plan.json"
    if not plan_file.is_file():
        raise ValueError(f"{plan_file}: no such file; pass the folder fxpipe split wrote "
                         f"({which})")
    try:
        return Plan.from_json(plan_file.read_text())
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{plan_file}: not a plan fxpipe wrote ({type(exc).__name__}: {exc}); "
                         f"run fxpipe split again") from None


def read_card(measured: str | Path, plan_dir: str | Path | None = None) -> ReportCard:
    """The report card of ``measured`` against the plan.json in ``plan_dir`` (default: the
    folder of ``measured``); what the comparison doubts is a ``warnings.warn``."""
    from fxpipe.report.card import compare
    from fxpipe.runtime.measured_file import load_measured

    card = load_measured(measured)
    folder = Path(plan_dir) if plan_dir is not None else Path(measured).parent
    plan = read_plan(folder, "the plan that was measured")
    return compare(plan, card, source=str(measured), plan_source=str(folder / "plan.json"))
