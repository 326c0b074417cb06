"""The README and docs/ as a reader meets them: short enough to read, every link leading
somewhere, the set-up commands those CI runs, and the usage block every flag of
``fxpipe --help``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fxpipe import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
INSTALL = ("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip "
           "install -e '.[dev]' && .venv/bin/fxpipe split examples/gpt.py --gpus 4")
TESTS = ".venv/bin/python -m pytest -q -n 2"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_the_readme_is_read_in_minutes() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 160, len(lines)
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:2] == ["## Why fxpipe", "## Quick start"], headings


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_leads_to_a_file_and_heading(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} leads to no file"
        if anchor:
            assert anchor in _anchors(target), f"{page.name}: {link} has no such heading"


def test_the_set_up_commands_are_those_ci_runs() -> None:
    """README's two commands, as written, and .ci/run running each part of them."""
    readme = README.read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"```\n{INSTALL}\n```" in readme
    assert f"```\n{TESTS}\n```" in readme
    for part in INSTALL.split(" && "):
        assert any(line.startswith(part.replace("pip install", "pip install -q"))
                   or line.startswith(part) for line in ci.splitlines()), part
    assert TESTS in ci.splitlines()


def test_the_usage_block_names_every_flag_of_help() -> None:
    readme = README.read_text(encoding="utf-8")
    usage = readme[readme.index("## Usage"):]
    block = usage[usage.index("```"):usage.index("```", usage.index("```") + 3)]
    commands = cli._parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, command in commands.items():
        assert f"fxpipe {name} " in block, name
        for action in command._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert re.search(rf"{re.escape(flag)}\b", block), f"{name} {flag}"


def test_the_error_table_and_the_pages_moved_from_the_readme_are_there() -> None:
    """What the README held moved to docs/: each page is there with its matter."""
    expected = {
        "errors.md": "| situation | message |",
        "model-files.md": "def batch_dims():",
        "package.md": "fxpipe merge stage0.pt stage1.pt",
        "schedules.md": "| `--schedule zbv` |",
        "report-card.md": "runner.measure(warmup=1)",
    }
    for name, text in expected.items():
        assert text in (ROOT / "docs" / name).read_text(encoding="utf-8"), name
