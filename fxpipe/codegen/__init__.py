"""Plan + graph -> Python source: stage modules, a runner, a package."""

from fxpipe.codegen.package import generate
from fxpipe.runtime import (
    check_stage_states,
    load_package,
    merge_stage_state_dicts,
    split_state_dict,
)

__all__ = [
    "check_stage_states",
    "generate",
    "load_package",
    "merge_stage_state_dicts",
    "split_state_dict",
]
