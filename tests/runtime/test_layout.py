"""The runtime is a leaf: torch and the standard library only, small modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

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
