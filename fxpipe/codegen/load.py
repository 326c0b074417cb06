"""Import a package that ``fxpipe split`` wrote, from wherever its folder is."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from pathlib import Path

__all__ = ["load_package"]

_count = itertools.count()


def load_package(folder: str | Path, name: str | None = None) -> types.ModuleType:
    """The generated package in ``folder`` (its ``__init__.py``, ``runner``, stages),
    imported as ``name`` (default: a fresh name, so two packages never collide)."""
    path = Path(folder).resolve()
    init = path / "__init__.py"
    if not init.is_file():
        raise ValueError(
            f"{folder}: no generated package here (no __init__.py); run "
            f"fxpipe split MODEL --out {folder} first"
        )
    name = name or f"fxpipe_package_{next(_count)}"
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(path)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package  # its modules import each other relative to it
    spec.loader.exec_module(package)
    return package
