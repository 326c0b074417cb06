"""fx's ``forward`` as the lines of a hand-written one: re-indented into the class, the
values it frees as ``del``, long lines wrapped, submodules by name rather than
``getattr``, PEP 8's keyword spacing, a shape comment where it fits."""

from __future__ import annotations

import ast
import io
import json
import re
import textwrap
import tokenize
from collections.abc import Callable

from fxpipe.codegen.wrap import LINE_LENGTH, wrap_line
from fxpipe.cut import StageIO

__all__ = ["Index", "forward_lines", "names_in"]

# (the model path of a module the stage holds, the name of one of its children) -> the
# subscript that reads the child (``[0]``, ``["key"]``), None where it has none
Index = Callable[[str, str], "str | None"]


_FREE = re.compile(r"^(?P<stmt>.*?);  (?P<dead>(?:[A-Za-z_]\w* = )+)None$")
_ASSIGN = re.compile(r"^    (?P<name>[A-Za-z_]\w*) = ")


def forward_lines(
    src: str,
    io: StageIO,
    shapes: dict[str, str],
    readable: dict[str, str] | None = None,
    *,
    indent: str = "    ",
    renamed: dict[str, str] | None = None,
    entry: list[str] | None = None,
    index: Index | None = None,
    doc: str | None = None,
) -> tuple[list[str], set[str]]:
    """fx's ``forward`` re-indented into the class, frees as ``del``, long lines wrapped.

    ``doc``: its docstring (default: what it returns, ``io.outputs``). ``readable``: value
    name -> the full-name read (``self.get_parameter("a.0.w")``) of a parameter or buffer,
    for a read that cannot be written as attributes and indices (``index``) or is too long
    that way. ``index``: how the stage indexes its modules."""
    raw = [line for line in src.strip("\n").splitlines() if line.strip()]
    assert raw[0].startswith("def forward(self"), raw[0]
    out = wrap_line(indent + raw[0], LINE_LENGTH)
    outs = ", ".join(io.outputs)
    out += [f'{indent}    """{doc or f"Returns ({outs})."}"""']
    if doc is None and len(out[-1]) > LINE_LENGTH:
        out[-1:] = [f'{indent}    """Returns, in order:', *(f"{indent}    {o}" for o in io.outputs),
                    f'{indent}    """']
    out += entry or []
    for line in raw[1:]:
        match = _FREE.match(line)
        dead: list[str] = []
        if match:
            line = match["stmt"]
            dead = [d for d in match["dead"].split(" = ") if d]
        assign = _ASSIGN.match(line)
        line = _hand_written(line, renamed or {}, index)
        full_name = readable.get(assign["name"]) if assign and readable else None
        comment = shapes.get(assign["name"], "") if assign else ""
        with_comment = f"{line}  # {comment}" if comment else line
        if full_name is not None and "get_submodule(" in line:
            out += _state_read(f"{indent}{line}", full_name, comment)
        elif len(indent + with_comment) <= LINE_LENGTH:
            out.append(indent + with_comment)
        elif full_name is not None:
            out += _state_read(f"{indent}{line}", full_name, comment)
        else:
            out += wrap_line(indent + line, LINE_LENGTH)
        while dead:
            # as many names per `del` as fit on a line
            take = 1
            while take < len(dead) and len(_del(indent, dead[: take + 1])) <= LINE_LENGTH:
                take += 1
            out += wrap_line(_del(indent, dead[:take]), LINE_LENGTH)
            dead = dead[take:]
    return out, names_in(src.strip("\n"))


def _state_read(line: str, full_name: str, comment: str) -> list[str]:
    """A parameter or buffer read too long for one line with its comment, or one that
    attributes and indices cannot reach: the read without the comment, or in parentheses
    on a line of its own as ruff's formatter writes it, else by its full name
    (``self.get_parameter("a.b")``)."""
    indent = line[: len(line) - len(line.lstrip())]
    name, _, value = line.strip().partition(" = ")
    inner = f"{indent}    {value}"
    if "get_submodule(" not in value and len(line) <= LINE_LENGTH:
        return [line]
    if "get_submodule(" not in value and len(inner) <= LINE_LENGTH:
        return [f"{indent}{name} = (", inner, f"{indent})"]
    by_name = f"{indent}{name} = {full_name}"
    with_comment = f"{by_name}  # {comment}" if comment else by_name
    if len(with_comment) <= LINE_LENGTH:
        return [with_comment]
    return wrap_line(by_name, LINE_LENGTH)


def _hand_written(line: str, renamed: dict[str, str], index: Index | None = None) -> str:
    """One statement of fx's code as a person writes it: ``self.blocks[0]`` for
    ``getattr(self.blocks, "0")`` (``self.get_submodule("blocks.0")`` where ``index`` has
    no index for it), ``dim=2`` for ``dim = 2``, globals in ``renamed`` by their new
    names."""
    indent = line[: len(line) - len(line.lstrip())]
    text = line.strip()
    while "getattr(" in text:  # (most statements have nothing to rewrite: no parse)
        tree = ast.parse(text)
        edit = next(
            (
                (node, _submodule(text, node, index))
                for node in _innermost_first(tree)
                if _submodule(text, node, index) is not None
            ),
            None,
        )
        if edit is None:
            break
        node, replacement = edit
        text = _replace(text, node, str(replacement))
    if any(name in text for name in renamed):
        tree = ast.parse(text)
        names = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in renamed]
        for node in sorted(names, key=lambda n: n.col_offset, reverse=True):
            text = _replace(text, node, renamed[node.id])
    return indent + (_tight_keywords(text) if text.count("=") > 1 else text)


def _innermost_first(tree: ast.AST) -> list[ast.AST]:
    return sorted(ast.walk(tree), key=lambda n: getattr(n, "col_offset", 0), reverse=True)


def _submodule(text: str, node: ast.AST, index: Index | None) -> str | None:
    """``self.a[0]`` (or ``self.get_submodule("a.0")``) for ``getattr(self.a, "0")``;
    None for other nodes."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 2
        and not node.keywords
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return None
    parent = _path_of(node.args[0])
    if parent is None:
        return None
    leaf = node.args[1].value
    subscript = index(parent, leaf) if index is not None else None
    if subscript is not None:
        return (ast.get_source_segment(text, node.args[0]) or "") + subscript
    return f"self.get_submodule({json.dumps(f'{parent}.{leaf}' if parent else leaf)})"


def _path_of(expr: ast.expr) -> str | None:
    """The model path a stage expression names: "" for ``self``, "blocks.0.mlp" for
    ``self.blocks[0].mlp`` or ``self.get_submodule("blocks.0").mlp``; None for anything
    but attributes, constant indices and ``get_submodule`` calls on ``self``."""
    if isinstance(expr, ast.Name):
        return "" if expr.id == "self" else None
    if isinstance(expr, ast.Attribute):
        owner, name = expr.value, expr.attr
    elif (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant)
          and type(expr.slice.value) in (int, str)):
        owner, name = expr.value, str(expr.slice.value)
    elif (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)
          and expr.func.attr == "get_submodule" and len(expr.args) == 1 and not expr.keywords
          and isinstance(expr.args[0], ast.Constant) and isinstance(expr.args[0].value, str)):
        owner, name = expr.func.value, expr.args[0].value
    else:
        return None
    path = _path_of(owner)
    if path is None:
        return None
    return f"{path}.{name}" if path else name


def _replace(text: str, node: ast.AST, replacement: str) -> str:
    start = len(text.encode()[: node.col_offset].decode())  # type: ignore[attr-defined]
    end = len(text.encode()[: node.end_col_offset].decode())  # type: ignore[attr-defined]
    return text[:start] + replacement + text[end:]


def _tight_keywords(text: str) -> str:
    """``f(x, dim=2)`` for fx's ``f(x, dim = 2)``: the same tokens, PEP 8's spacing."""
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    depth = 0
    cuts: list[tuple[int, int]] = []  # spans of spaces to remove
    for before, token, after in zip(tokens, tokens[1:], tokens[2:], strict=False):
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        elif token.type == tokenize.OP and token.string == "=" and depth > 0:
            cuts += [(before.end[1], token.start[1]), (token.end[1], after.start[1])]
    for start, end in sorted(cuts, reverse=True):
        assert not text[start:end].strip(), text
        text = text[:start] + text[end:]
    return text


def _del(indent: str, names: list[str]) -> str:
    return f"{indent}    del {', '.join(names)}"



def names_in(text: str) -> set[str]:
    """Names the code reads as variables (not attribute names, not strings)."""
    tree = ast.parse(textwrap.dedent(text))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
