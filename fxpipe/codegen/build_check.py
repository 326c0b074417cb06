"""The generated package imported and its stages built against the model, before any
file is written: a package that cannot be built is never written as a success.

Each stage binds the model's own objects by name and looks up the model file's
functions when it is built (``stages.py``); a name the stage reads that the model does
not have (a constant the tracer made, a function found otherwise than the user's
process can) fails there, in the user's training script, after ``fxpipe split`` said
OPTIMAL. ``check_builds`` builds every stage against the model as ``build_stages``
would, from a temporary copy of the files: binding holds the model's tensors, it makes
none, so this costs no memory and works on the meta device as on the CPU.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from fxpipe.runtime.loading import load_package

__all__ = ["PackageBuildError", "check_builds"]

_count = itertools.count()


class PackageBuildError(RuntimeError):
    """A generated stage does not build against the model: a fault of fxpipe's code
    generator, found before anything was written."""


def check_builds(files: Mapping[str, str], model: torch.nn.Module) -> None:
    """Import the package of ``files`` (file name -> text, as ``generate`` gives them) and
    build each of its stages against ``model``; a ``PackageBuildError`` naming the first
    stage that fails and why."""
    name = f"fxpipe_build_check_{next(_count)}"
    with tempfile.TemporaryDirectory(prefix="fxpipe-check-") as folder:
        for relative, text in files.items():
            path = Path(folder) / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # (a throwaway)
        try:
            try:
                package = load_package(folder, name)
            except Exception as exc:
                raise PackageBuildError(
                    f"the generated package does not import ({_one_line(exc)}); nothing "
                    "was written") from exc
            for k, stage in enumerate(package.STAGE_CLASSES):
                try:
                    stage(model)
                except Exception as exc:
                    raise PackageBuildError(
                        f"stage{k}.py does not build against the model ({_one_line(exc)}); "
                        "nothing was written") from exc
        finally:
            sys.dont_write_bytecode = bytecode
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]


def _one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
