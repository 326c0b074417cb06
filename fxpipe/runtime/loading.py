"""Import a Python file, or a package folder, by its path.

The one way fxpipe and a generated package import code from a path: the user's
model file, a generated package from wherever its folder is.
"""

import importlib.util
import itertools
import sys
import types
from pathlib import Path

__all__ = ["NotPythonError", "import_file", "load_package"]

_count = itertools.count()


class NotPythonError(ValueError):
    """A path Python cannot import as a module (not a .py file)."""


def import_file(path: str | Path, name: str, *, package: bool = False) -> types.ModuleType:
    """Execute the file ``path`` as module ``name`` (registered in ``sys.modules``
    before it runs, so it can import itself and, as a ``package``, its submodules
    relative to its folder). A file (not a package) finds the modules beside it, as
    ``python file.py`` would: its folder joins ``sys.path``, after the installed packages
    so that a file there named like one of them shadows nothing. Errors raised by the file
    propagate; a path Python cannot import as a module is a ``NotPythonError``."""
    file = Path(path)
    here = str(file.resolve().parent)
    folder = [here] if package else None
    if not package and here not in sys.path:
        sys.path.append(here)
    spec = importlib.util.spec_from_file_location(name, file, submodule_search_locations=folder)
    if spec is None or spec.loader is None:
        raise NotPythonError(f"{path}: cannot be imported as Python; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


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
    return import_file(init, name or f"fxpipe_package_{next(_count)}", package=True)
