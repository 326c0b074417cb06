"""The report card: a plan's predictions next to what a training step measured.

Per stage, predicted and measured forward, backward and communication seconds (per
micro-batch) and memory, each with the ratio measured / predicted; the stage that is
the real bottleneck (largest measured forward + backward + communication) and whether
it is the one the plan expected. Whether a re-plan would move a cut needs the model's
op costs, which plan.json does not hold: ``fxpipe report ... --model MODEL`` re-plans and
says, ``fxpipe split MODEL --calibrate measured.json`` writes the re-made plan.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from fxpipe.plan import Plan
from fxpipe.runtime.measured_file import REMEASURE, Measured, plan_identity
from fxpipe.units import format_bytes, format_ms

__all__ = ["TIE", "ReportCard", "StageRow", "check_measures", "compare", "overlap_caveat",
           "render_card"]

# Stages measured within this fraction of the slowest tie with it. A step's stage times
# on one H100 moved by up to 1 % from one run of the same plan to the next (BENCHMARKS.md).
TIE = 0.02


@dataclass(frozen=True)
class StageRow:
    index: int
    predicted: tuple[float, float, float]  # forward, backward, comm seconds per micro-batch
    measured: tuple[float, float, float]
    predicted_memory: int
    measured_memory: int | None
    device: str  # where it was measured
    shared: bool = False  # another stage was measured on the same device

    @property
    def predicted_s(self) -> float:
        return sum(self.predicted)

    @property
    def measured_s(self) -> float:
        return sum(self.measured)

    @property
    def ratios(self) -> tuple[float | None, float | None, float | None]:
        f, b, c = (ratio(m, p) for m, p in zip(self.measured, self.predicted, strict=True))
        return f, b, c

    @property
    def memory_ratio(self) -> float | None:
        """None where not measured, or where the peak is a shared device's."""
        if self.measured_memory is None or self.shared:
            return None
        return ratio(self.measured_memory, self.predicted_memory)


@dataclass(frozen=True)
class ReportCard:
    """A plan's figures against what a training step measured of it (``compare``)."""

    plan: Plan
    measured: Measured
    rows: tuple[StageRow, ...]

    @property
    def planned_bottleneck(self) -> int:
        return max(self.rows, key=lambda r: r.predicted_s).index

    @property
    def measured_bottleneck(self) -> int:
        return max(self.rows, key=lambda r: r.measured_s).index

    @property
    def behind(self) -> float:
        """How far below the measured bottleneck the planned one measured, as a fraction
        of the measured bottleneck's time (0 when they are the same stage)."""
        slowest = self.rows[self.measured_bottleneck].measured_s
        planned = self.rows[self.planned_bottleneck].measured_s
        return 1.0 - planned / slowest if slowest > 0 else 0.0

    @property
    def holds(self) -> bool:
        """The planned bottleneck is the measured one, or measured within ``TIE`` of it:
        a plan balances its stages, so its slowest few are near ties, and a few per cent
        is the spread of one step to the next."""
        return self.behind <= TIE

    @property
    def predicted_step_s(self) -> float:
        """The step the plan predicts on the devices measured: its pipelined step, or,
        where stages shared a device, that device's work one stage after another
        (M x the sum of their forward and backward; nothing crosses a link), whichever
        is longer."""
        m = self.plan.microbatches
        in_turn = [m * sum(self.rows[k].predicted[0] + self.rows[k].predicted[1] for k in ks)
                   for ks in self.measured.shared.values()]
        return max([self.plan.estimate.iteration_s, *in_turn])


def ratio(measured: float, predicted: float) -> float | None:
    return measured / predicted if predicted > 0 else None


def compare(plan: Plan, measured: Measured, *, source: str = "the measurement",
            plan_source: str = "the plan") -> ReportCard:
    """The plan's figures against ``measured``; a ValueError if they are not of one plan
    (``check_measures``; ``source`` and ``plan_source`` name the two in it). A measurement
    that does not name its plan (written before they did) is compared as given, with a
    warning."""
    if measured.plan is None:
        warnings.warn(
            f"{source} does not name the plan it measured (it was written before "
            f"measurements did), so nothing checks that it measured {plan_source}, "
            f"{plan_identity(plan.to_dict())}; {REMEASURE} to have it checked", stacklevel=2)
    check_measures(plan, measured, source=source, plan_source=plan_source)
    shared = {k for stages in measured.shared.values() for k in stages}
    rows = tuple(
        StageRow(
            index=stage.index,
            predicted=(stage.forward_s, stage.backward_s, stage.comm_s),
            measured=(m.forward_s, m.backward_s, m.comm_s),
            predicted_memory=stage.memory.total,
            measured_memory=m.peak_memory_bytes,
            device=m.device,
            shared=stage.index in shared,
        )
        for stage, m in zip(plan.stages, measured.stages, strict=True)
    )
    return ReportCard(plan=plan, measured=measured, rows=rows)


def check_measures(plan: Plan, measured: Measured, *, source: str = "the measurement",
                   plan_source: str = "the plan") -> None:
    """A ValueError unless ``measured`` is a measurement of ``plan``: the plan it names (a
    measurement that names none passes), its stages and its micro-batches per step."""
    given = plan_identity(plan.to_dict())
    if measured.plan is not None and measured.plan != given:
        raise ValueError(
            f"{source} measured {measured.plan}, not {plan_source}, {given}; pass the folder "
            f"of the plan that was measured, or {REMEASURE} with this plan's package"
        )
    if len(measured.stages) != plan.num_stages:
        raise ValueError(
            f"{source} has {len(measured.stages)} stages but the plan has {plan.num_stages}; "
            f"measure the package this plan generated"
        )
    if measured.microbatches != plan.microbatches:
        raise ValueError(
            f"{source} ran {measured.microbatches} micro-batches per step but the plan has "
            f"{plan.microbatches}; measure the package this plan generated"
        )


def render_card(card: ReportCard) -> str:
    """The report card as Markdown: a table per stage, then the verdict."""
    m = card.measured
    lines = [
        f"# Report card: {card.plan.model or 'plan'} on {m.device}",
        "",
        f"Measured {m.steps} steps ({m.clock} clock), {m.microbatches} micro-batches each; "
        f"times per micro-batch, ratio = measured / predicted.",
        "",
        "| stage | forward | backward | comm | memory | stage time |",
        "|---|---|---|---|---|---|",
    ]
    for row in card.rows:
        cells = [
            _cell(format_ms(p), format_ms(x), r)
            for p, x, r in zip(row.predicted, row.measured, row.ratios, strict=True)
        ]
        if row.measured_memory is None:
            memory = f"{format_bytes(row.predicted_memory)} → not measured"
        elif row.shared:
            memory = f"{format_bytes(row.predicted_memory)} → shared {row.device}"
        else:
            memory = _cell(format_bytes(row.predicted_memory),
                           format_bytes(row.measured_memory), row.memory_ratio)
        total = _cell(format_ms(row.predicted_s), format_ms(row.measured_s),
                      ratio(row.measured_s, row.predicted_s))
        lines.append(f"| {row.index} | " + " | ".join([*cells, memory, total]) + " |")
    predicted_step = card.predicted_step_s
    lines += [
        "",
        *_shared_lines(card),
        f"Step: predicted {format_ms(predicted_step)}, measured {format_ms(m.step_s)}"
        + _times(ratio(m.step_s, predicted_step)) + ".",
        _bottleneck_line(card),
        "Whether a re-plan with these measurements moves a cut: add `--model MODEL`; "
        "`fxpipe split MODEL --calibrate MEASURED.json` writes that plan.",
    ]
    if m.clock == "wall":
        lines.append("Measured on the CPU by wall clock: the ratios compare this machine "
                     f"with the plan's device ({card.plan.device or 'unknown'}).")
    return "\n".join(lines) + "\n"


def _bottleneck_line(card: ReportCard) -> str:
    planned, measured = card.planned_bottleneck, card.measured_bottleneck
    line = f"Bottleneck: planned stage {planned}, measured stage {measured}"
    if planned != measured:
        line += f"; stage {planned} measured {card.behind:.1%} below it"
        if card.holds:
            line += f", within the {TIE:.0%} of a tie"
    return line + (" — the plan's choice holds." if card.holds
                   else " — the plan's choice does not hold.")


def _shared_lines(card: ReportCard) -> list[str]:
    """What a shared device changes: the step predicted, whose peak a peak is, and
    whether stage times overlapped."""
    lines = []
    for device, ks in card.measured.shared.items():
        rows = [card.rows[k] for k in ks]
        line = (f"Stages {_listed(ks)} shared {device}: the step predicted there is their "
                f"work one after another, M × Σ (forward + backward)")
        peak = rows[0].measured_memory
        if peak is not None:
            together = sum(r.predicted_memory for r in rows)
            line += (f"; its peak, {format_bytes(peak)}, is theirs together (predicted at "
                     f"most {format_bytes(together)} with every stage at its peak at once: "
                     f"×{peak / together:.2f})")
        lines.append(line + ".")
    for device, ks in card.measured.overlapped.items():
        caveat = overlap_caveat(device, ks)
        lines.append(caveat[0].upper() + caveat[1:] + ".")
    return lines


def overlap_caveat(device: str, ks: tuple[int, ...]) -> str:
    """Why the times of stages that ran side by side on one GPU are not each stage's own
    (``Measured.overlapped``), in the words of the card and of a calibrated plan's note."""
    return (f"stages {_listed(ks)} ran side by side on {device}, on streams of their own, "
            "so each one's times include the others' kernels; measure with "
            "runner.measure(serial=True) to time each alone, the times to calibrate from")


def _listed(ks: tuple[int, ...]) -> str:
    return ", ".join(str(k) for k in ks[:-1]) + f" and {ks[-1]}"


def _times(r: float | None) -> str:
    return "" if r is None else f" (×{r:.2f})"


def _cell(predicted: str, measured: str, r: float | None) -> str:
    return f"{predicted} → {measured}{_times(r)}"
