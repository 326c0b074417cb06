"""A library package laid out as torchvision.ops is: the package re-exports the function
``stochastic_depth`` under the name of the module that defines it, so
``tests.codegen._ops.stochastic_depth`` is the function, not the module."""

from .stochastic_depth import StochasticDepth, stochastic_depth

__all__ = ["StochasticDepth", "stochastic_depth"]
