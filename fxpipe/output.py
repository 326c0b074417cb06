"""Write an output folder all or nothing.

Files go to a temporary sibling first; only when every file is written does the
folder take the place of ``--out``. A failure or Ctrl-C at any point leaves no
folder, or the previous one untouched. A folder fxpipe did not write is never
replaced without ``force``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["MARKER", "OutputExistsError", "OutputWriteError", "write_folder"]

MARKER = ".fxpipe"  # present in every folder fxpipe writes


class OutputExistsError(ValueError):
    """--out names a folder fxpipe did not write."""


class OutputWriteError(ValueError):
    """The file system refused a write (full disk, permissions); nothing was replaced."""


def write_folder(out: Path, files: Mapping[str, str | bytes], *, force: bool = False) -> None:
    out = Path(out)
    if out.exists() and not (out / MARKER).exists() and not force:
        kind = "folder" if out.is_dir() else "file"
        raise OutputExistsError(
            f"{out} is an existing {kind} that fxpipe did not write; choose another --out "
            "or pass --force to replace it"
        )
    staging: Path | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        for name, content in sorted({**files, MARKER: "written by fxpipe\n"}.items()):
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content, encoding="utf-8")
        _swap_in(staging, out)
    except OSError as exc:
        _discard(staging)
        reason = exc.strerror or type(exc).__name__
        raise OutputWriteError(
            f"could not write {out}: {reason}; free some space or choose another --out "
            "(nothing was changed)"
        ) from exc
    except BaseException:
        _discard(staging)
        raise


def _discard(staging: Path | None) -> None:
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(staging: Path, out: Path) -> None:
    """Put ``staging`` at ``out``; an existing ``out`` comes back if the swap fails."""
    if not out.exists():
        staging.rename(out)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    out.rename(retired / out.name)
    try:
        staging.rename(out)
    except BaseException:
        (retired / out.name).rename(out)
        shutil.rmtree(retired, ignore_errors=True)
        raise
    shutil.rmtree(retired, ignore_errors=True)
