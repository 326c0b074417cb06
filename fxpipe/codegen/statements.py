"""fx's ``forward`` as the lines of a hand-written one: re-indented into the class, the
values it frees as ``del``, long lines wrapped, submodules by name rather than
``getattr``, PEP 8's keyword spacing, a shape comment where it fits."""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize

from fxpipe.codegen.wrap import LINE_LENGTH, wrap_line
from fxpipe.cut import StageIO

__all__ = ["forward_lines", "names_in"]


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
) -> tuple[list[str], set[str]]:
    """fx's ``forward`` re-indented into the class, frees as ``del``, long lines wrapped."""
    raw = [line for line in src.strip("\n").splitlines() if line.strip()]
    assert raw[0].startswith("def forward(self"), raw[0]
    out = wrap_line(indent + raw[0], LINE_LENGTH)
    outs = ", ".join(io.outputs)
    out += [f'{indent}    """Returns ({outs})."""' if outs else f'{indent}    """Returns ()."""']
    if len(out[-1]) > LINE_LENGTH:
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
        if assign and readable and assign["name"] in readable and (
            "getattr(" in line or len(indent + line) > LINE_LENGTH
        ):
            line = f"    {assign['name']} = {readable[assign['name']]}"
        line = _hand_written(line, renamed or {})
        comment = shapes.get(assign["name"], "") if assign else ""
        with_comment = f"{line}  # {comment}" if comment else line
        if len(indent + with_comment) <= LINE_LENGTH:
            out.append(indent + with_comment)
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


def _hand_written(line: str, renamed: dict[str, str]) -> str:
    """One statement of fx's code as a person writes it: ``self.get_submodule("blocks.0")``
    for ``getattr(self.blocks, "0")``, ``dim=2`` for ``dim = 2``, globals in ``renamed``
    by their new names."""
    indent = line[: len(line) - len(line.lstrip())]
    text = line.strip()
    while True:
        tree = ast.parse(text)
        edit = next(
            (
                (node, _submodule(text, node))
                for node in _innermost_first(tree)
                if _submodule(text, node) is not None
            ),
            None,
        )
        if edit is None:
            break
        node, replacement = edit
        text = _replace(text, node, str(replacement))
    tree = ast.parse(text)
    names = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in renamed]
    for node in sorted(names, key=lambda n: n.col_offset, reverse=True):
        text = _replace(text, node, renamed[node.id])
    return indent + _tight_keywords(text)


def _innermost_first(tree: ast.AST) -> list[ast.AST]:
    return sorted(ast.walk(tree), key=lambda n: getattr(n, "col_offset", 0), reverse=True)


_SELF_PATH = re.compile(r'^self(?:\.get_submodule\("([\w.]+)"\))?((?:\.[A-Za-z_]\w*)*)$')


def _submodule(text: str, node: ast.AST) -> str | None:
    """``self.get_submodule("a.0")`` for ``getattr(self.a, "0")``; None for other nodes."""
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
    owner = ast.get_source_segment(text, node.args[0]) or ""
    match = _SELF_PATH.match(owner)
    if match is None:
        return None
    path = ((match[1] or "") + match[2]).strip(".")
    leaf = node.args[1].value
    return f'self.get_submodule("{path}.{leaf}")' if path else f'self.get_submodule("{leaf}")'


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
