"""The memory rule on random models: planned onto one stage with ``--device cpu`` and one
micro-batch, a model's activation bytes are the bytes of the storages autograd keeps for
backward in a real forward of the traced graph on this CPU (parameters, buffers and the
stage's inputs, which the plan counts as received, left out). The random ops make views,
aliases, in-place changes, chunks, regions and Functions in any order: each storage must
be counted once, whoever keeps which view of it.

One known, bounded difference: a BatchNorm in eval mode keeps two empty statistics on the
CPU where the meta kernel (which the plan runs) gives them one value per channel, so the
plan may be over by 2 x channels elements per such call, never under.

Fast profile (default suite): 8 examples. Long profile: ``FXPIPE_FUZZ_EXAMPLES=500``.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, Phase, given, settings

from fxpipe.compiler import analyze
from fxpipe.frontend import trace
from tests.passes.test_saved_bytes import CPU, planned_activations, real_saved_bytes

from .models import ModelSpec, build_model, example_inputs, model_specs

EXAMPLES = int(os.environ.get("FXPIPE_FUZZ_EXAMPLES", "8"))


def eval_batchnorm_slack(spec: ModelSpec) -> int:
    """Bytes the plan may count over for BatchNorm calls in eval mode (see above)."""
    if spec.train:
        return 0
    features = {name: arg[0] for name, (kind, arg) in spec.modules.items()
                if kind.startswith("batchnorm")}
    element = torch.empty((), dtype=torch.float64).element_size()
    return sum(2 * features[op.module] * element for op in spec.ops if op.module in features)


@settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(spec=model_specs())
def test_planned_activations_are_what_autograd_keeps(spec: ModelSpec) -> None:
    args, kwargs = example_inputs(spec, batch=max(2, spec.min_batch), seed=1)
    traced = trace(build_model(spec), args, kwargs)
    analyze(traced, device=CPU)
    planned, real = planned_activations(traced), real_saved_bytes(traced)
    assert real <= planned <= real + eval_batchnorm_slack(spec), (planned, real)
