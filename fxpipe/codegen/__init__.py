"""Plan + graph -> Python source: stage modules, a runner, a package."""

from fxpipe.codegen.package import generate
from fxpipe.runtime import load_package, merge_stage_state_dicts, split_state_dict

__all__ = [
    "generate",
    "load_package",
    "merge_stage_state_dicts",
    "split_state_dict",
]
