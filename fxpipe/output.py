"""Write an output folder all or nothing.

Files go to a temporary sibling first; only when every file is written does the
folder take the place of ``--out``, with SIGINT and SIGTERM held back during the
two renames. A failure, Ctrl-C or SIGTERM at any point leaves no folder, or the
previous one untouched, and no hidden temporary folder. A folder fxpipe did not
write is never replaced without ``force``; the current folder never.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from fxpipe.signals import deferred

__all__ = ["MARKER", "OutputExistsError", "OutputWriteError", "write_folder"]

MARKER = ".fxpipe"  # present in every folder fxpipe writes


class OutputExistsError(ValueError):
    """--out names a folder fxpipe did not write."""


class OutputWriteError(ValueError):
    """The file system refused a write (full disk, permissions); nothing was replaced."""


def write_folder(out: Path, files: Mapping[str, str | bytes], *, force: bool = False) -> None:
    given = Path(out)  # as the user wrote it, for messages
    out = Path(os.path.abspath(given))  # "." has no name or parent to stage beside
    _check_replaceable(out, given, force=force)
    staging: Path | None = None
    swapped = False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with deferred():  # a signal between mkdtemp and the assignment would leak it
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp",
                                            dir=out.parent))
        for name, content in sorted({**files, MARKER: "written by fxpipe\n"}.items()):
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content, encoding="utf-8")
        staging.chmod(_folder_mode())  # mkdtemp makes it 0700; mkdir would honour umask
        # Between the renames the previous folder lives only in a hidden one: a signal
        # there waits until the new folder is in place and the old one removed.
        with deferred():
            _swap_in(staging, out)
            swapped = True
    except OSError as exc:
        _discard(staging)
        reason = exc.strerror or type(exc).__name__
        raise OutputWriteError(
            f"could not write {given}: {reason}; free some space or choose another --out "
            "(nothing was changed)"
        ) from exc
    except BaseException as exc:
        _discard(staging)
        if swapped and hasattr(exc, "add_note"):  # a signal held back during the swap
            exc.add_note(f"{given} had been written in full")
        raise


def _check_replaceable(out: Path, given: Path, *, force: bool) -> None:
    """Refuse to replace a folder fxpipe did not write (without ``force``), and the
    current folder or one holding it (ever: the whole folder is replaced)."""
    if not out.exists():
        return
    here = Path.cwd().resolve()
    if out.is_dir() and (out.resolve() == here or out.resolve() in here.parents):
        raise OutputExistsError(
            f"--out {given} is the current folder or holds it, and fxpipe replaces --out as a "
            "whole; choose a new folder, e.g. --out fxpipe-out"
        )
    if not (out / MARKER).exists() and not force:
        kind = "folder" if out.is_dir() else "file"
        raise OutputExistsError(
            f"{given} is an existing {kind} that fxpipe did not write; choose another "
            "--out or pass --force to replace it"
        )


def _folder_mode() -> int:
    """What ``mkdir`` would give a new folder under the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _discard(staging: Path | None) -> None:
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(staging: Path, out: Path) -> None:
    """Put ``staging`` at ``out``; an existing ``out`` comes back if the swap fails."""
    if not out.exists():
        staging.rename(out)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    try:
        out.rename(retired / out.name)
    except BaseException:
        retired.rmdir()
        raise
    try:
        staging.rename(out)
    except BaseException:
        (retired / out.name).rename(out)
        shutil.rmtree(retired, ignore_errors=True)
        raise
    shutil.rmtree(retired, ignore_errors=True)
