"""The transparency rule on random models: split by the whole pipeline onto a random
number of stages, under any schedule kind (with replicated stages and interleaved
virtual stages), micro-batch count and recompute setting, the generated package's
forward equals the model's and its step leaves the model's gradients (see
pipeline.py for the oracle of BatchNorm, bfloat16 autocast and PipeDream); and the same
stages as torchrun runs them (each a ``StageAdapter``, recomputing), chained in one
process on one micro-batch, give the model's output, gradients and buffers. The package
is checked at the traced batch and at two other row counts, and a quarter as many models
again are traced at one sample with a table of one row (HF Llama's rotary table).

Fast profile (default suite): 16 examples in two halves and 4 traced at one sample, drawn
anew each run (the suite keeps within its 10 minutes on 2 cores). Long profile:
``FXPIPE_FUZZ_EXAMPLES=1000 pytest tests/fuzz/test_transparency.py`` or
``python bench/fuzz_long.py``.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fxpipe.schedules import ScheduleKind

from .models import model_specs
from .pipeline import Case, check_adapters, check_transparency

EXAMPLES = int(os.environ.get("FXPIPE_FUZZ_EXAMPLES", "16"))


SCHEDULES = [kind.value for kind in ScheduleKind]  # the single-process runner runs them all


@st.composite
def cases(draw: st.DrawFn, *, one_row: bool = False) -> Case:
    """A random model and how to split it. The split settings come from a seeded
    ``random.Random``: uniform, where hypothesis would favour 1 stage and 1 micro-batch.

    PipeDream's models use every parameter once (a tie keeps everything between its
    readers on one stage: fxpipe refuses that with ``PipedreamTieError``). Stages are
    replicated (by the solver, or in the runner over the plan's) only where a micro-batch
    can be cut among replicas: not under a zero-bubble schedule (the runner refuses
    replicas with I and W actions), nor with BatchNorm in training mode (each replica
    would normalize with its own chunk's statistics; fxpipe warns), nor where the oracle
    runs micro-batch by micro-batch for reduced precision (a replica's smaller chunk may
    round differently: the unsplit model has no such run to compare with).

    ``one_row``: traced at one sample, with a table of one row and a batch count made
    first and read late (HF Llama's rotary table), the runner's stages maybe replicated
    over the plan's, as a model file's example of one sample is split."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    kind = ScheduleKind(rng.choice(SCHEDULES))
    spec = draw(model_specs(reuse=kind is not ScheduleKind.PIPEDREAM, table=one_row or None))
    plan_flag = rng.random() < 0.5  # one recompute flag in the plan, else one per stage
    replicable = not kind.spec.splits_backward and not spec.per_microbatch
    one_per_gpu = kind.spec.interleaved or kind.spec.v_placed
    # selective recompute runs a backward once: not where the schedule splits it in two
    selective = not kind.spec.splits_backward
    policies = ["none", "all", *["selective"] * selective]
    # a keep rule keeps some matmuls' outputs and reruns the others
    modes = ["none", "full", *["selective", "selective:64:32"] * selective]
    replicate = replicable and not one_per_gpu and not one_row and rng.random() < 0.25
    replicas = (tuple(rng.choice([1, 2]) for _ in range(4))
                if replicable and rng.random() < 0.25 else None)
    # Traced with a sample per replica at least (a batch of one is traced as a constant).
    batch = max(rng.randint(1, 2), spec.min_batch, 2 if replicate or replicas else 1)
    if one_row:
        batch = spec.min_batch
    # With one sample, an input of one row may be per sample or broadcast: with several
    # inputs fxpipe says it cannot tell and asks for batch_dims() (see
    # tests/transparency/test_shared_inputs.py), so the fuzzer declares them.
    rows = [shape[0] for shape, _vocab in spec.shared]
    ambiguous = batch == 1 and len(spec.inputs) + rows.count(1) > 1
    return Case(
        spec=spec,
        stages=rng.randint(1, 4),
        schedule=kind.value,
        microbatches=rng.randint(1, 4),
        recompute=rng.choice(policies) if plan_flag else tuple(
            rng.choice(modes) for _ in range(4)),
        batch=batch,
        virtual_stages=rng.choice([2, 2, 3]),
        replicate=replicate,
        replicas=replicas,
        declare=ambiguous or rng.random() < 0.5,
        rows=tuple(rng.sample([1, 2, 3, 5], 2)),  # checked at these too, not only the traced
    )


# No shrinking: a model that fails is printed in full (its Case repr rebuilds it), and
# shrinking one through the whole pipeline takes minutes. Two halves of the examples, each
# drawn anew, so that the suite's two workers share them (48 took 48-150 s as one test,
# often the last one running).
@pytest.mark.parametrize("half", ["first", "second"])
@settings(max_examples=max(1, EXAMPLES // 2), deadline=None,
          suppress_health_check=list(HealthCheck), database=None,
          phases=[Phase.explicit, Phase.generate])
@given(case=cases())
def test_split_models_are_transparent(half: str, case: Case) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        done = check_transparency(case, Path(tmp) / "pkg")
        check_adapters(case, done)


# Traced at one sample, checked at other row counts: a stage took a table of one row
# for its rows (tests/transparency/test_one_row_trace.py).
@settings(max_examples=max(1, EXAMPLES // 4), deadline=None,
          suppress_health_check=list(HealthCheck), database=None,
          phases=[Phase.explicit, Phase.generate])
@given(case=cases(one_row=True))
def test_models_traced_at_one_row_are_transparent_at_any_rows(case: Case) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        done = check_transparency(case, Path(tmp) / "pkg")
        check_adapters(case, done)
