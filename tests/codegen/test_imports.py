"""The import block of a stage is what ruff's isort rule and line length accept: a
module's plain names merged, each aliased name a statement of its own, long statements
in parentheses (torchvision's swin_t imports three wrapped functions under aliases)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.codegen.imports import _isort
from fxpipe.codegen.wrap import LINE_LENGTH

RUFF = [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", "I,E501",
        "--line-length", str(LINE_LENGTH), "--target-version", "py310"]

SWIN = {
    "from torch import nn",
    "from torchvision.models.swin_transformer import _get_relative_position_bias as "
    "_get_relative_position_bias_function",
    "from torchvision.models.swin_transformer import _patch_merging_pad as "
    "_patch_merging_pad_function",
    "from torchvision.models.swin_transformer import shifted_window_attention as "
    "shifted_window_attention_function",
    "from torchvision.ops.stochastic_depth import stochastic_depth as stochastic_depth_function",
}


def _complaints(lines: list[str], folder: Path) -> str:
    (folder / "block.py").write_text("\n".join(lines) + "\n", encoding="utf-8")
    done = subprocess.run([*RUFF, "block.py"], capture_output=True, text=True, cwd=folder)
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_aliased_imports_of_one_module_are_statements_of_their_own(tmp_path: Path) -> None:
    lines = _isort(SWIN | {"import torch"})
    assert lines[:2] == ["import torch", "from torch import nn"]
    assert "from torchvision.models.swin_transformer import (" in lines
    assert _complaints(lines, tmp_path) == ""


MODULES = st.sampled_from(["m", "torch", "torchvision.ops.misc", "a.rather.long.module.path_name"])
MEMBERS = st.sampled_from(["CONST", "Module", "fn", "_private", "zeta", "Alpha", "scaled_residual",
                           "a_function_with_a_rather_long_name_indeed"])
ALIASES = st.sampled_from(["", "fn_function", "Alias", "z", "scaled_residual_function"])


@settings(max_examples=40, deadline=None)
@given(st.sets(st.tuples(MODULES, MEMBERS, ALIASES), min_size=1, max_size=12))
def test_any_import_block_passes_ruff(tmp_path_factory, imports) -> None:  # type: ignore[no-untyped-def]
    statements = {f"from {module} import {member}" + (f" as {alias}" if alias else "")
                  for module, member, alias in imports}
    assert _complaints(_isort(statements), tmp_path_factory.mktemp("imports")) == ""
