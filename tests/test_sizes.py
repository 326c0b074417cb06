"""No god-objects anywhere in the library: each module, class and function stays small.

The runtime has tighter limits of its own (tests/runtime/test_layout.py): it is copied
into every generated package and read there by users.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fxpipe

PACKAGE = Path(fxpipe.__file__).parent
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 600, 350, 100


def test_no_module_class_or_function_is_a_god_object() -> None:
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(PACKAGE).as_posix()
        if text.count("\n") > MODULE_LINES:
            too_big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            limit = (CLASS_LINES if isinstance(node, ast.ClassDef)
                     else FUNCTION_LINES if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                     else None)
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_big.append(f"{name}: {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big
