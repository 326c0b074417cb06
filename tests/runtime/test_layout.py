"""The runtime is a leaf: torch and the standard library only, small modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import fxpipe.runtime

RUNTIME = Path(fxpipe.runtime.__file__).parent


def test_runtime_imports_only_torch_and_the_standard_library() -> None:
    for path in sorted(RUNTIME.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # its own modules
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                assert top == "torch" or top in sys.stdlib_module_names, (path.name, name)


def test_no_module_class_or_function_is_a_god_object() -> None:
    limits = {ast.ClassDef: 350, ast.FunctionDef: 100}
    for path in sorted(RUNTIME.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert text.count("\n") <= 400, path.name
        for node in ast.walk(ast.parse(text)):
            limit = limits.get(type(node))
            if limit is not None:
                assert node.end_lineno - node.lineno < limit, (path.name, node.name)


def test_each_public_name_is_found_where_its_home_says_and_read_once() -> None:
    """The top level imports a module on first use of one of its names (``_HOMES``); each
    name is the object its module defines, and after the first read a plain attribute."""
    homes = fxpipe.runtime._HOMES
    assert fxpipe.runtime.__all__ == sorted(homes)
    for name, module in homes.items():
        value = getattr(fxpipe.runtime, name)
        assert getattr(sys.modules[f"fxpipe.runtime.{module}"], name) is value, name
        assert vars(fxpipe.runtime)[name] is value, name
    with pytest.raises(AttributeError, match="no attribute 'Runner'"):
        fxpipe.runtime.Runner  # noqa: B018


def test_the_command_line_starts_without_torch() -> None:
    """``fxpipe --help`` and a mistyped flag answer before torch is imported (seconds on
    a cold start): the command line reads the schedules, which read runtime/schedule.py."""
    code = ("import sys, fxpipe.cli; "
            "code = fxpipe.cli.main(['split', 'model.py', '--gpus', '2', '--nodes', '2']); "
            "print(code, 'torch' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
    assert found.stdout.strip() == "2 False", found
    assert "unrecognized arguments: --nodes 2" in found.stderr
