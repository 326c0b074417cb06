"""The line wrapper: wrapped and unwrapped source parse to the same tree, for random
long statements with calls, subscripts, slices, tuples, displays and strings."""

from __future__ import annotations

import ast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.codegen.wrap import wrap_line, wrap_tuple

NAMES = st.sampled_from(["x", "h", "self", "torch", "getitem_1", "a_rather_long_value_name"])
ATOMS = st.one_of(
    NAMES,
    st.integers(-3, 10**12).map(str),
    st.sampled_from(["None", "...", "1.5", "-inf", '"a, b"', "'[0]'", '"("', "True"]),
)


def _expressions() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        items = st.lists(inner, min_size=1, max_size=5)
        index = st.one_of(
            inner,
            st.tuples(st.sampled_from(["", "1", "x"]), st.sampled_from(["", "2", "-1"])).map(
                lambda t: f"{t[0]}:{t[1]}"
            ),
        )
        return st.one_of(
            st.tuples(NAMES, items).map(lambda t: f"{t[0]}({', '.join(t[1])})"),
            st.tuples(NAMES, items, inner).map(
                lambda t: f"{t[0]}.f({', '.join(t[1])}, dim = {t[2]})"
            ),
            st.tuples(inner, st.lists(index, min_size=1, max_size=4)).map(
                lambda t: f"{t[0]}[{', '.join(t[1])}]"
            ),
            st.tuples(inner, items).map(lambda t: f"{t[0]}[({', '.join(t[1])})]"),
            st.tuples(inner, index).map(lambda t: f"{t[0]}[{t[1]}]"),
            inner.map(lambda e: f"({e},)"),
            items.map(lambda es: f"({', '.join(es)})"),
            items.map(lambda es: f"[{', '.join(es)}]"),
            items.map(lambda es: "{" + ", ".join(f"{e!r}: {e}" for e in es) + "}"),
            st.tuples(inner, inner).map(lambda t: f"({t[0]} + {t[1]}) * {t[0]}"),
            st.tuples(inner, inner).map(lambda t: f"({t[0]} + {t[1]})[{t[1]}]"),
            inner.map(lambda e: f"({e}).view(-1)"),
        )

    return st.recursive(ATOMS, extend, max_leaves=12)


EXPRESSIONS = _expressions()
STATEMENTS = st.one_of(
    EXPRESSIONS.map(lambda e: f"y = {e}"),
    EXPRESSIONS.map(lambda e: f"return {e}"),
    st.lists(EXPRESSIONS, min_size=2, max_size=4).map(lambda es: f"return {', '.join(es)}"),
    EXPRESSIONS,
)


def _tree(source: str) -> str:
    return ast.dump(ast.parse(source))


@settings(max_examples=250, deadline=None)
@given(STATEMENTS, st.integers(0, 3), st.integers(20, 100))
def test_wrapped_statements_parse_to_the_same_tree(statement: str, depth: int, limit: int) -> None:
    indent = "    " * depth
    lines = wrap_line(indent + statement, limit)
    wrapped = "\n".join(line[len(indent) :] for line in lines)
    assert _tree(wrapped) == _tree(statement)
    for line in lines:
        assert line.startswith(indent)
        _assert_ruff_takes(line, limit)


def _assert_ruff_takes(line: str, limit: int) -> None:
    """Neither too long for ruff's E501 nor marked without need (RUF100): within the
    limit, or one word (which ruff lets run on), or marked ``# noqa: E501`` and not so."""
    code, marked, _ = line.partition("  # noqa: E501")
    if marked:
        assert len(code) > limit and len(code.split()) > 1, line
    else:
        assert len(line) <= limit or len(line.split()) == 1, line


@settings(max_examples=100, deadline=None)
@given(EXPRESSIONS, st.integers(20, 100))
def test_wrapped_display_elements_parse_to_the_same_tree(element: str, limit: int) -> None:
    lines = wrap_line(f"    {element},", limit)
    assert _tree("[\n" + "\n".join(lines) + "\n]") == _tree(f"[{element},]")


def _unenclosed(expression: str) -> bool:
    """Not wrapped whole in parentheses of its own (``(self)``): wrap_line writes an
    element as its source segment, which leaves those out; the elements fxpipe hands to
    wrap_tuple (a schedule's ticks) never have them."""
    tree = ast.parse(expression, mode="eval")
    return ast.get_source_segment(expression, tree.body) == expression


@settings(max_examples=150, deadline=None)
@given(st.lists(EXPRESSIONS.filter(_unenclosed), min_size=1, max_size=12), st.integers(0, 2),
       st.sampled_from(["", ","]), st.integers(20, 100))
def test_a_tuple_is_written_as_wrap_line_writes_its_line(items: list[str], depth: int,
                                                          suffix: str, limit: int) -> None:
    """The schedule's ticks skip the parse: the lines must be wrap_line's to the byte."""
    indent = "    " * depth
    literal = f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    assert wrap_tuple(items, indent, suffix, limit) == wrap_line(
        f"{indent}{literal}{suffix}", limit)


def test_a_single_index_gets_no_trailing_comma() -> None:
    line = "        getitem = a_long_name_of_a_layer_norm_output[(slice(None, None, None), 0)]"
    lines = wrap_line(line, 60)
    assert lines[:2] == ["        getitem = a_long_name_of_a_layer_norm_output[",
                         "            (slice(None, None, None), 0)"]
    assert lines[-1] == "        ]"


def test_a_def_line_breaks_at_its_parameters() -> None:
    line = "def flatten_inputs(input_ids, attention_mask=None, scale=2.0) -> dict[str, object]:"
    assert wrap_line(line, 60) == [
        "def flatten_inputs(",
        "    input_ids,",
        "    attention_mask=None,",
        "    scale=2.0,",
        ") -> dict[str, object]:",
    ]


@pytest.mark.parametrize("line", ["y = ((x[x]).view(-1))", "y = (f(aaaa, bbbb, cccc))",
                                  "    ((a_long_name).f(b, c)),"])
def test_grouping_brackets_around_the_value_are_kept(line: str) -> None:
    # hypothesis found `y = ((x[x]).view(-1))` at 20 columns wrapped without its last `)`:
    # the value's text starts inside the grouping bracket, and what followed it was lost.
    lines = wrap_line(line, 20)
    if line.endswith(","):
        assert _tree("[\n" + "\n".join(lines) + "\n]") == _tree(f"[{line.strip()}]")
    else:
        assert _tree("\n".join(lines)) == _tree(line)
    assert len(lines) > 1


def test_a_piece_of_one_word_is_left_long_unmarked() -> None:
    """A full-name read's string alone on its line is one word: ruff's E501 lets it run
    on, so a ``# noqa: E501`` there is one ruff flags as unused (transformers' Swin had
    24 such lines). A long piece with spaces in it is marked."""
    path = "a." * 48 + "b"
    lines = wrap_line(f'    x = f("{path}", y)', 40)
    assert f'        "{path}",' in lines
    for line in lines:
        _assert_ruff_takes(line, 40)
    spaced = wrap_line(f'    x = f("{path} {path}", y)', 40)
    assert any(line.endswith("# noqa: E501") for line in spaced), spaced
