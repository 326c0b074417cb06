"""fxpipe: a pipeline-parallelism compiler for PyTorch.

    plan = fxpipe.split(model, example_inputs, gpus=4, out="pipe")  # plan, write the package
    plan = fxpipe.split_file("model.py", gpus=4)                    # a model file's model
    pipe = fxpipe.load_package("pipe")                               # the package, imported

Each name is imported on first use (module ``__getattr__``), so ``import fxpipe`` and the
command line's ``--help`` start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers see them (``X as X``: re-exported)
    from fxpipe.api import split as split
    from fxpipe.api import split_file as split_file
    from fxpipe.plan import Plan as Plan
    from fxpipe.runtime.loading import load_package as load_package

__version__ = "0.1.0"

# Each public name and the module that defines it.
_HOMES = {
    "Plan": "fxpipe.plan",
    "load_package": "fxpipe.runtime.loading",
    "split": "fxpipe.api",
    "split_file": "fxpipe.api",
}

__all__ = ["__version__", *sorted(_HOMES)]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later reads find it without this function
    return value
