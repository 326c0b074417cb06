"""Write an output folder all or nothing.

Files go to a temporary sibling first; only when every file is written does the
folder take the place of ``--out``, with SIGINT and SIGTERM held back during the
two renames. A failure, Ctrl-C or SIGTERM at any point leaves no folder, or the
previous one untouched, and no hidden temporary folder. A folder fxpipe did not
write is never replaced without ``force``; the current folder never. A symbolic
link at ``--out`` stays: the folder it points to is the one written.

``check_out`` refuses, before any slow work, an ``--out`` that a write would fail on
(a path under a file, a name too long, a folder the file system will not let fxpipe
write in); a write that still fails (a disk filling up) says why in the same words.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from fxpipe.signals import deferred

__all__ = ["MARKER", "OutputExistsError", "OutputWriteError", "check_out", "display_path",
           "write_folder"]

MARKER = ".fxpipe"  # present in every folder fxpipe writes

# What to do about each way the file system refuses a write (any other: another --out).
_FIXES = {
    errno.ENOSPC: "free some space or choose another --out",
    errno.EDQUOT: "free some of your disk quota or choose another --out",
    errno.EROFS: "choose an --out on a writable file system",
    errno.EACCES: "choose an --out in a folder you can write",
    errno.EPERM: "choose an --out in a folder you can write",
    errno.ENAMETOOLONG: "choose a shorter --out",
}


class OutputExistsError(ValueError):
    """--out names a folder fxpipe did not write."""


class OutputWriteError(ValueError):
    """The file system refused a write (full disk, permissions); nothing was replaced."""


def check_out(out: Path, *, force: bool = False) -> Path:
    """The folder that ``write_folder(out, ...)`` writes (``out`` made absolute, or the
    folder a link at ``out`` points to), refused now if the write could not succeed."""
    given = Path(out)
    target = _followed(given)
    shown = _shown(given, target)
    _check_replaceable(target, given, shown, force=force)
    _check_writable(target, given, shown)
    return target


def write_folder(out: Path, files: Mapping[str, str | bytes], *, force: bool = False) -> Path:
    """Write ``files`` (relative path -> content) as the folder ``out``, all or nothing;
    the folder written is returned (a link's target where ``out`` is a link)."""
    given = Path(out)  # as the user wrote it, for messages
    out = check_out(given, force=force)
    staging: Path | None = None
    swapped = False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with deferred():  # a signal between mkdtemp and the assignment would leak it
            staging = Path(tempfile.mkdtemp(prefix=_hidden(out.name), suffix=".tmp",
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
        where = Path(exc.filename).parent if exc.filename else out.parent
        if staging is not None and (where == staging or staging in where.parents):
            where = out.parent  # not the hidden folder the user never named
        raise _write_error(exc, _shown(given, out), where) from exc
    except BaseException as exc:
        _discard(staging)
        if swapped and hasattr(exc, "add_note"):  # a signal held back during the swap
            exc.add_note(f"{given} had been written in full")
        raise
    return out


def _followed(given: Path) -> Path:
    """``given`` made absolute ("." has no name or parent to stage beside), a symbolic
    link there followed to the folder it points to: replacing the link itself would
    leave its target stale and the link gone."""
    out = Path(os.path.abspath(given))
    if not os.path.islink(out):  # os.path's tests are False, not raising, on too long a name
        return out
    try:
        target = out.resolve()
    except (RuntimeError, OSError) as exc:  # a loop: RuntimeError up to Python 3.12
        if isinstance(exc, OSError) and exc.errno != errno.ELOOP:
            raise _write_error(exc, str(given), out.parent) from None
        raise OutputWriteError(
            f"--out {given} is a symbolic link that leads back to itself; point it at a "
            "folder or choose another --out (nothing was changed)") from None
    if not os.path.exists(target) and not os.path.isdir(target.parent):
        state = "is not a folder" if os.path.lexists(target.parent) else "does not exist"
        raise OutputWriteError(
            f"--out {given} is a symbolic link to {display_path(target)}, whose folder "
            f"{display_path(target.parent)} {state}; point the link at a folder that exists "
            "or choose another --out (nothing was changed)")
    return target


def _shown(given: Path, target: Path) -> str:
    """``--out`` in messages: as the user wrote it, and where a link there leads."""
    if target == Path(os.path.abspath(given)):
        return str(given)
    return f"{given} (a link to {display_path(target)})"


def display_path(path: Path) -> Path:
    """An absolute ``path`` for messages: relative to the current folder where it lies
    inside it, else as it is."""
    here = Path.cwd()
    return path.relative_to(here) if here in path.parents else path


def _check_replaceable(out: Path, given: Path, shown: str, *, force: bool) -> None:
    """Refuse to replace a folder fxpipe did not write (without ``force``), and the
    current folder or one holding it (ever: the whole folder is replaced)."""
    if not os.path.exists(out):
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
            f"{shown} is an existing {kind} that fxpipe did not write; choose another "
            "--out or pass --force to replace it"
        )


def _check_writable(out: Path, given: Path, shown: str) -> None:
    """Refuse an ``out`` the file system will not take: one under a file, a name longer
    than a name may be there, or a folder fxpipe may not create folders in (read-only,
    permissions), found by making and removing a hidden file where ``out`` goes."""
    existing, missing = out.parent, [out.name]
    while not os.path.lexists(existing):  # the folders mkdir(parents=True) would make
        missing.append(existing.name)
        existing = existing.parent
    if not os.path.isdir(existing):
        what = ("a file" if os.path.isfile(existing) else
                "a symbolic link to nothing" if os.path.islink(existing) else "something")
        raise OutputWriteError(
            f"could not write {shown}: {display_path(existing)} is {what}, not a folder; "
            "choose an --out outside it (nothing was changed)")
    try:
        longest = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):  # no limit the file system will tell
        longest = 255
    for name in missing:
        if len(os.fsencode(name)) > longest:
            raise OutputWriteError(
                f"could not write {shown}: the name {name[:24]}... is "
                f"{len(os.fsencode(name))} bytes long, more than the {longest} a name may "
                "have there; choose a shorter --out (nothing was changed)")
    try:
        with deferred():  # the probe is removed even if a signal comes
            handle, probe = tempfile.mkstemp(prefix=_hidden(out.name), suffix=".tmp",
                                             dir=existing)
            os.close(handle)
            os.remove(probe)
    except OSError as exc:
        raise _write_error(exc, shown, existing) from None


def _write_error(exc: OSError, shown: str, where: Path) -> OutputWriteError:
    """The one line for a write the file system refused in ``where``: its reason, the fix."""
    reason = exc.strerror or type(exc).__name__
    fix = _FIXES.get(exc.errno or 0, "choose another --out")
    return OutputWriteError(
        f"could not write {shown}: {reason} in {display_path(where)}; {fix} (nothing was "
        "changed)")


def _hidden(name: str) -> str:
    """The prefix of a hidden folder beside ``name``: mkdtemp adds 8 characters and the
    suffix, so a long name is cut to keep the whole within a name's 255 bytes."""
    return f".{name[:40]}."


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
    retired = Path(tempfile.mkdtemp(prefix=_hidden(out.name), suffix=".old", dir=out.parent))
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
