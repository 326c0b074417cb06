"""The transparency rule on random models: split by the whole pipeline onto a random
number of stages, schedule, micro-batch count and recompute setting, the generated
package's forward equals the model's and its step leaves the model's gradients.

Fast profile (default suite): 100 examples. Long profile:
``FXPIPE_FUZZ_EXAMPLES=1000 pytest tests/fuzz/test_transparency.py`` or
``python bench/fuzz_long.py``.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from .models import model_specs
from .pipeline import Case, check_transparency

EXAMPLES = int(os.environ.get("FXPIPE_FUZZ_EXAMPLES", "100"))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A random model and how to split it. The split settings come from a seeded
    ``random.Random``: uniform, where hypothesis would favour 1 stage and 1 micro-batch."""
    spec = draw(model_specs())
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    plan_flag = rng.random() < 0.5  # one recompute flag in the plan, else one per stage
    return Case(
        spec=spec,
        stages=rng.randint(1, 4),
        schedule=rng.choice(["gpipe", "1f1b"]),
        microbatches=rng.randint(1, 4),
        recompute=rng.random() < 0.5 if plan_flag else tuple(
            rng.random() < 0.5 for _ in range(4)),
        batch=rng.randint(1, 2),
    )


# No shrinking: a model that fails is printed in full (its Case repr rebuilds it), and
# shrinking one through the whole pipeline takes minutes.
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          database=None, phases=[Phase.explicit, Phase.generate])
@given(case=cases())
def test_split_models_are_transparent(case: Case) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        check_transparency(case, Path(tmp) / "pkg")
