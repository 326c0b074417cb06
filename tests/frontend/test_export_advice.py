"""The fix fxpipe names when torch.export cannot capture forward, by what stopped it."""

from __future__ import annotations

import pytest

from fxpipe.tracing.export import advice

LIFTED = ("We found a fake tensor in the exported program constant's list. This typically "
          "means our tracing system encountered an op that we can't trace through. For the "
          "potential source, you can refer to following model attribute: {}. Please file an "
          "issue on github. ")


@pytest.mark.parametrize(("attribute", "owner"), [
    ("model.layers.0.lifted_tensor_0", " (in model.layers.0)"),  # transformers' Gemma3n
    ("lifted_tensor_0", ""),
])
def test_a_tensor_kept_or_changed_in_forward_names_its_module(attribute: str,
                                                               owner: str) -> None:
    said = advice(RuntimeError(LIFTED.format(attribute)))
    assert said == ("make forward leave the model's tensors as they are: it changes one in "
                    f"place through .data or keeps a tensor it made{owner}, which "
                    "torch.export cannot capture")


def test_each_cause_has_its_own_fix() -> None:
    swapped = advice(RuntimeError("_apply(): Couldn't swap Linear.weight"))
    branched = advice(RuntimeError("Could not guard on data-dependent expression Eq(u0, 1)"))
    numpy = advice(RuntimeError(".numpy() is not supported for tensor subclasses."))
    other = advice(TypeError("'NoneType' object is not subscriptable"))
    assert "module.to(...)" in swapped
    assert branched == "make forward free of data-dependent Python control flow"
    assert "data-dependent" in numpy and ".numpy()" in numpy
    assert "data-dependent" not in other and "is_compiling()" in other
