"""A model's way out of fxpipe that is no Exception: ``sys.exit`` in its forward, or a
``class Stop(BaseException)`` of its own, raised while fxpipe traces or runs it.

Loading the model file words those its functions raise (``frontend``); the command
words the rest with ``worded``, one line naming the model's line, rather than let them
end the process with a traceback, or silently with the model's exit status.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path

__all__ = ["worded"]


def worded(exc: BaseException) -> str | None:
    """"FILE:LINE: what the model did; the fix" for ``exc`` raised in the model's code,
    or None where no frame of its traceback is the model's (then it is fxpipe's)."""
    frame = _model_frame(exc)
    if frame is None:
        return None
    where = f"{_shown(Path(frame.filename))}:{frame.lineno}"
    if isinstance(exc, SystemExit):
        return (f"{where}: sys.exit({exc.code!r}) was called while fxpipe ran the model; "
                "return or raise an exception instead")
    text = (str(exc).strip().splitlines() or [""])[0][:200]
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"{where}: the model raised {what} while fxpipe ran it; fix the model and run again"


def _model_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback outside fxpipe, the standard library and
    the installed packages (torch, transformers' modeling code): the model's own."""
    paths = sysconfig.get_paths()
    outside = (str(Path(__file__).parent), paths["stdlib"], paths["platstdlib"],
               paths["purelib"], paths["platlib"], "<")
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(outside)]
    return frames[-1] if frames else None


def _shown(path: Path) -> Path:
    """``path`` relative to the current folder where it lies inside it."""
    here = Path(os.getcwd())
    return path.relative_to(here) if here in path.parents else path
