"""The plan keeps the split with the shortest step, not only the least slowest stage.

The search minimises the slowest stage, which decides the step where micro-batches are
many; with one micro-batch the step runs each stage once, and the GPT's layer-count cuts,
sending less, make a shorter one than the split with the least slowest stage. The plan
printed "fxpipe (cp-sat) ... 0.703 ms" above "uniform-layers ... 0.693 ms", and the
layout search a chosen layout slower than the same degrees cut by hand."""

from __future__ import annotations

from pathlib import Path

import fxpipe

GPT = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"


def _fitting_steps(plan: fxpipe.Plan) -> dict[str, float]:
    return {name: e.iteration_s for name, e in plan.baselines.items() if e.fits}


def test_with_one_micro_batch_the_shorter_step_of_a_baselines_cuts_is_kept() -> None:
    plan = fxpipe.split_file(GPT, gpus=2, pp=2, microbatches=1)
    steps = _fitting_steps(plan)
    assert plan.estimate.iteration_s == min(steps.values())
    assert plan.solver.method in steps and plan.solver.method == min(steps, key=steps.get)
    # what was proved is of the bottleneck: the kept split's is above the least one
    assert plan.solver.bound < plan.solver.objective == plan.estimate.bottleneck_s
    assert plan.solver.status == "FEASIBLE"
    assert any(note.startswith(f"the cuts are the {plan.solver.method} baseline's: a step of "
                               "1 micro-batch runs each stage once") for note in plan.notes)


def test_with_many_micro_batches_the_search_split_stays() -> None:
    plan = fxpipe.split_file(GPT, gpus=2, pp=2, microbatches=16)
    assert plan.solver.method == "cp-sat" and plan.solver.status == "OPTIMAL"
    assert plan.estimate.iteration_s <= min(_fitting_steps(plan).values())
    assert not any(note.startswith("the cuts are") for note in plan.notes)


def test_the_chosen_layout_is_no_slower_than_its_degrees_cut_by_hand() -> None:
    plan = fxpipe.split_file(GPT, gpus=8, microbatches=4)
    layout = plan.layout
    assert layout is not None and layout.microbatches == 1
    chosen = next(row for row in layout.considered if row.status == "chosen")
    by_hand = [row for row in layout.considered if row.status == "by hand"
               and (row.pp, row.dp) == (chosen.pp, chosen.dp)]
    assert by_hand and all(chosen.step_s <= row.step_s for row in by_hand)
