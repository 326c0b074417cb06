"""Long generated lines broken at brackets, from the syntax tree, never by text.

A text wrapper that splits at "the last bracket's commas" cannot tell a call from
an index: it turns ``h[(slice(None), 0)]`` into ``h[(slice(None), 0),]``, a tuple
of a tuple, which selects other elements. Here a line is parsed, and only nodes
whose brackets may hold a line break and a trailing comma without changing the
tree are broken: calls, tuples, lists, sets, dicts, and subscripts (a single index
is put on its own line without a comma). Every other piece is copied from the
original text. The result is parsed again and must give the same tree (an assert:
a failure is a bug here, not in the user's model).

    wrap_line("    x = f(a, b)", 12)   ->  ["    x = f(", "        a,", "        b,", "    )"]

Besides whole statements, ``wrap_line`` takes the two fragments the package
headers write: an element of a bracketed display (``    (0, "F", 1),``) and a
``def`` line (``def f(a, b) -> int:``).
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Sequence

__all__ = ["LINE_LENGTH", "wrap_line", "wrap_tuple"]

LINE_LENGTH = 100  # the runtime copied into runner.py is written to 100 columns

_STEP = "    "
_NOQA = "  # noqa: E501"


def wrap_line(line: str, limit: int = LINE_LENGTH) -> list[str]:
    """``line`` as lines of at most ``limit`` columns that parse to the same tree.

    A piece that cannot be broken (a long name, string or operator chain) stays
    whole and its line is marked ``# noqa: E501`` (``_fit``).
    """
    if len(line) <= limit:
        return [line]
    indent = line[: len(line) - len(line.lstrip())]
    text = line.strip()
    if text.endswith(":") and text.startswith(("def ", "async def ")):
        lines = _def_header(text, indent, limit)
        harness = ("", "\n" + _STEP + "pass")
    elif text.endswith(","):
        lines = _fragment(text[:-1], indent, ",", limit)
        harness = ("[\n", "\n]")
    else:
        lines = _statement(text, indent, limit)
        harness = ("", "")
    if lines is None:
        return [_fit(line, limit)]
    before = _dump(harness[0] + text + harness[1])
    after = _dump(harness[0] + "\n".join(_dedent(lines, indent)) + harness[1])
    assert before == after, f"wrapping changed the meaning of {line!r}: {lines}"
    return lines


def wrap_tuple(items: Sequence[str], indent: str, suffix: str = "",
               limit: int = LINE_LENGTH) -> list[str]:
    """The tuple display of ``items`` (the texts of its elements, none enclosed whole in
    parentheses of its own) after ``indent`` and before ``suffix``, as ``wrap_line``
    writes that line (on one line where it fits, else an element per line), without
    parsing it: a schedule's thousands of ticks."""
    line = f"{indent}({items[0]},){suffix}" if len(items) == 1 else (
        f"{indent}({', '.join(items)}){suffix}")
    broken = [f"{indent}(", *(f"{indent}{_STEP}{item}," for item in items), f"{indent}){suffix}"]
    if len(line) <= limit or max(map(len, broken)) > limit:
        return wrap_line(line, limit)
    return broken


def _dump(source: str) -> str:
    return ast.dump(ast.parse(source))


def _dedent(lines: list[str], indent: str) -> list[str]:
    assert all(line.startswith(indent) for line in lines), lines
    return [line[len(indent) :] for line in lines]


def _parse(source: str, mode: str = "exec") -> ast.AST | None:
    try:
        return ast.parse(source, mode=mode)
    except SyntaxError:
        return None


# ---------------------------------------------------------------------------- statements


def _statement(text: str, indent: str, limit: int) -> list[str] | None:
    tree = _parse(text)
    if not isinstance(tree, ast.Module) or len(tree.body) != 1:
        return None
    node = tree.body[0]
    value: ast.expr | None
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Return, ast.Expr)):
        value = node.value
    else:
        return None
    if value is None:
        return None
    # What surrounds the value, grouping brackets included: ``y = ((a).f(b))``'s value
    # is ``(a).f(b)``, between ``y = (`` and ``)``.
    prefix, rest = text[: _offset(text, value)], text[_offset(text, value, end=True) :]
    if isinstance(value, ast.Tuple) and not _parenthesized(text, value):
        # ``return a, b`` breaks as ``return (`` ... ``)``: the same tuple
        head = indent + prefix + "("
        return _bracketed(text, head, "", list(value.elts), ")", rest, indent, limit, True)
    return _expr(text, value, indent + prefix, rest, indent, limit)


def _fragment(text: str, indent: str, suffix: str, limit: int) -> list[str] | None:
    tree = _parse(text, "eval")
    if not isinstance(tree, ast.Expression):
        return None
    body = tree.body
    prefix, rest = text[: _offset(text, body)], text[_offset(text, body, end=True) :]
    return _expr(text, body, indent + prefix, rest + suffix, indent, limit)


def _def_header(text: str, indent: str, limit: int) -> list[str] | None:
    tree = _parse(text + " pass")
    if not isinstance(tree, ast.Module) or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    func = tree.body[0]
    open_at = text.index("(")
    close_at = _matching(text, open_at)
    pieces = _top_level_split(text, open_at + 1, close_at)
    if any(p.strip() in ("*", "/") for p in pieces) or not pieces:
        return None  # keyword-only or positional-only markers: keep the text as it is
    assert len(pieces) == len(func.args.args) + len(func.args.kwonlyargs) + bool(
        func.args.vararg
    ) + bool(func.args.kwarg), pieces
    step = indent + _STEP
    rest = text[close_at:]
    one = f"{indent}{text[: open_at + 1]}"
    lines = [one, *(_fit(f"{step}{p.strip()},", limit) for p in pieces), indent + rest]
    return lines


# ---------------------------------------------------------------------------- expressions


def _expr(
    text: str, node: ast.expr, prefix: str, suffix: str, indent: str, limit: int
) -> list[str]:
    """``node`` starting after ``prefix`` and followed by ``suffix``, broken as needed."""
    whole = _segment(text, node)
    if len(prefix + whole + suffix) <= limit:
        return [prefix + whole + suffix]
    if isinstance(node, ast.Call):
        items: list[ast.AST] = sorted([*node.args, *node.keywords], key=_position)
        head = prefix + _head(text, node, node.func, "(")
        return _bracketed(text, head, "", items, ")", suffix, indent, limit, True)
    if isinstance(node, ast.Subscript):
        head = prefix + _head(text, node, node.value, "[")
        index = node.slice
        if isinstance(index, ast.Tuple) and not _parenthesized(text, index):
            return _bracketed(text, head, "", list(index.elts), "]", suffix, indent, limit, True)
        return _bracketed(text, head, "", [index], "]", suffix, indent, limit, False)
    bracketed = isinstance(node, (ast.List, ast.Set, ast.Dict)) or (
        isinstance(node, ast.Tuple) and _parenthesized(text, node)
    )
    if bracketed:
        items = _display_items(node)
        return _bracketed(text, prefix, whole[0], items, whole[-1], suffix, indent, limit, True)
    return [_fit(prefix + whole + suffix, limit)]


def _bracketed(
    text: str,
    head: str,
    opening: str,
    items: list[ast.AST],
    closing: str,
    suffix: str,
    indent: str,
    limit: int,
    comma: bool,
) -> list[str]:
    """``head + opening``, one item per line, ``closing + suffix``.

    ``comma``: every item is followed by a comma (a call's arguments, a display's
    elements); without it there is exactly one item (a single index).
    """
    assert comma or len(items) == 1, items
    step = indent + _STEP
    lines = [_fit(head + opening, limit)]
    for item in items:
        after = "," if comma else ""
        if isinstance(item, ast.keyword):
            if item.arg is None:
                lines += _expr(text, item.value, step + "**", after, step, limit)
            else:
                lines += _expr(text, item.value, f"{step}{item.arg}=", after, step, limit)
        elif isinstance(item, _DictItem):
            if item.key is None:
                lines += _expr(text, item.value, step + "**", after, step, limit)
            else:
                key = _segment(text, item.key)
                lines += _expr(text, item.value, f"{step}{key}: ", after, step, limit)
        elif isinstance(item, ast.GeneratorExp) and not _segment(text, item).startswith("("):
            lines.append(_fit(f"{step}({_segment(text, item)}){after}", limit))
        elif isinstance(item, ast.Starred):
            lines.append(_fit(f"{step}{_segment(text, item)}{after}", limit))
        else:
            assert isinstance(item, ast.expr), item
            lines += _expr(text, item, step, after, step, limit)
    lines.append(_fit(indent + closing + suffix, limit))
    return lines


class _DictItem(ast.AST):
    """One ``key: value`` (or ``**value``) of a dict display."""

    def __init__(self, key: ast.expr | None, value: ast.expr) -> None:
        super().__init__()
        self.key, self.value = key, value


def _display_items(node: ast.expr) -> list[ast.AST]:
    if isinstance(node, ast.Dict):
        return [_DictItem(k, v) for k, v in zip(node.keys, node.values, strict=True)]
    assert isinstance(node, (ast.Tuple, ast.List, ast.Set)), node
    return list(node.elts)


# ---------------------------------------------------------------------------- text


def _segment(text: str, node: ast.AST) -> str:
    if isinstance(node, ast.keyword):
        name = "**" if node.arg is None else f"{node.arg}="
        return name + _segment(text, node.value)
    assert node.end_lineno == 1, (text, ast.dump(node))  # type: ignore[attr-defined]
    # A slice of the one line: ``ast.get_source_segment`` splits the whole text into
    # lines in Python at every call, 2 s of the 70B runner's header.
    return text[_offset(text, node) : _offset(text, node, end=True)]


def _offset(text: str, node: ast.AST, end: bool = False) -> int:
    """The character offset of where ``node`` starts (or ends) in the one-line ``text``
    (the tree counts UTF-8 bytes)."""
    assert getattr(node, "lineno", 1) == 1, ast.dump(node)
    column = node.end_col_offset if end else node.col_offset  # type: ignore[attr-defined]
    if text.isascii():
        return column
    return len(text.encode("utf-8")[:column].decode("utf-8"))


def _head(text: str, node: ast.expr, inner: ast.expr, bracket: str) -> str:
    """The text of ``node`` up to and including the ``bracket`` that follows ``inner``:
    ``f(`` of a call, ``(a + b)[`` of a subscript (the grouping kept)."""
    at = text.index(bracket, _offset(text, inner, end=True))
    assert not text[_offset(text, inner, end=True) : at].strip(") "), text
    return text[_offset(text, node) : at + 1]


def _position(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset  # type: ignore[attr-defined]


def _parenthesized(text: str, node: ast.Tuple) -> bool:
    """Whether the tuple has brackets of its own (``(a), b`` starts with one it has not)."""
    whole = _segment(text, node)
    return whole.startswith("(") and _matching(whole, 0) == len(whole) - 1


def _fit(line: str, limit: int) -> str:
    """``line``, marked ``# noqa: E501`` where ruff would flag it as too long: over
    ``limit`` and of more than one word (ruff lets a line of one word run on, and flags a
    mark that marks nothing)."""
    return line if len(line) <= limit or len(line.split()) < 2 else line + _NOQA


def _operators(text: str) -> list[tuple[int, str]]:
    """(offset, text) of the operators and brackets of the one-line ``text``, strings skipped."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [(t.start[1], t.string) for t in tokens if t.type == tokenize.OP]


def _matching(text: str, open_at: int) -> int:
    """The offset of the bracket closing the one at ``open_at``."""
    depth = 0
    for at, op in _operators(text):
        if at < open_at:
            continue
        if op in "([{":
            depth += 1
        elif op in ")]}":
            depth -= 1
            if depth == 0:
                return at
    raise AssertionError(f"no closing bracket in {text!r}")


def _top_level_split(text: str, begin: int, end: int) -> list[str]:
    """``text[begin:end]`` split at its commas outside brackets (and strings)."""
    pieces: list[str] = []
    depth = 0
    for at, op in _operators(text):
        if not begin <= at < end:
            continue
        if op in "([{":
            depth += 1
        elif op in ")]}":
            depth -= 1
        elif op == "," and depth == 0:
            pieces.append(text[begin:at])
            begin = at + 1
    if text[begin:end].strip():
        pieces.append(text[begin:end])
    return pieces
