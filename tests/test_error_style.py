"""One style for every error message fxpipe raises: it starts in lower case and ends without
a full stop, as the table in docs/errors.md does. The command line prints it after
``fxpipe: error:``, and Python after ``ValueError:``, so it reads as the rest of that line.

A message may start with a name that keeps its case (``PipelineRunner``, ``DualPipeV``) or
with a value (an f-string's first field); several clauses are joined by ``;`` or ``:``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fxpipe"


def _literal_ends(message: ast.expr) -> tuple[str, str] | None:
    """The leading and trailing literal text of a string or f-string (empty where a field
    stands first or last); None for a message built elsewhere."""
    if isinstance(message, ast.Constant) and isinstance(message.value, str):
        return message.value, message.value
    if isinstance(message, ast.JoinedStr) and message.values:
        first, last = message.values[0], message.values[-1]
        return (first.value if isinstance(first, ast.Constant) else "",
                last.value if isinstance(last, ast.Constant) else "")
    return None


def _messages() -> list[tuple[str, str, str]]:
    """(where, leading text, trailing text) of each message written at a raise site, or
    handed to an exception class's ``super().__init__``; assertions are not for users."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            call = None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                if ast.unparse(node.exc.func) != "AssertionError":
                    call = node.exc
            elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "super().__init__"):
                call = node
            if call is None or not call.args:
                continue
            ends = _literal_ends(call.args[0])
            if ends is not None:
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", *ends))
    return found


def _breaks_style(leading: str, trailing: str) -> str | None:
    word = re.match(r"[A-Za-z]+", leading)
    if word and word.group()[0].isupper() and word.group()[1:].islower():
        return f"starts with the capitalised word {word.group()!r}"
    if trailing.endswith(".") and not trailing.endswith("..."):
        return "ends with a full stop"
    return None


def test_raised_messages_start_in_lower_case_and_end_without_a_full_stop() -> None:
    messages = _messages()
    assert len(messages) > 150  # the scan finds the package's messages
    broken = [f"{where}: {why}" for where, leading, trailing in messages
              if (why := _breaks_style(leading, trailing))]
    assert not broken, "\n".join(broken)


def test_the_rule_tells_the_two_styles_apart() -> None:
    assert _breaks_style("Cannot cut ", " stages or fewer.") is not None
    assert _breaks_style("cannot cut ", " stages or fewer.") == "ends with a full stop"
    assert _breaks_style("cannot cut ", " stages or fewer") is None
    assert _breaks_style("PipelineRunner needs at least one stage", "") is None
    assert _breaks_style("", "") is None  # a field first and last
    assert _breaks_style("shape (", "...") is None  # an ellipsis is not a full stop


def test_the_documented_messages_share_the_style() -> None:
    table = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| [^|]+ \| `(.*)` \|$", table, flags=re.M)
    assert len(rows) > 40
    broken = [row for row in rows if _breaks_style(row, row)]
    assert not broken, "\n".join(broken)
