"""Plan + graph -> Python source: stage modules, a runner, a package."""

from fxpipe.codegen.package import generate, schedule_table
from fxpipe.runtime import load_package, merge_stage_state_dicts, split_state_dict

__all__ = [
    "generate",
    "load_package",
    "merge_stage_state_dicts",
    "schedule_table",
    "split_state_dict",
]
