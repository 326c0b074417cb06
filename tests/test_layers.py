"""docs/design.md's two tables, held: the layers (which module may import which) and the
home of each idea (the files and names it cites exist).

The layer table lists every module of the package once, in rows from the bottom of the
stack up; a module imports only from its own row and the rows above it. The import graph
is read with ``ast`` (imports inside functions and under ``TYPE_CHECKING`` count: a lazy
import is a dependency all the same).

Run as a script, it prints the import graph's summary (modules, imports, circles, upward
imports): ``python tests/test_layers.py``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fxpipe"
DESIGN = ROOT / "docs" / "design.md"


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading`` in design.md, as cells."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:]  # the header row


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layers() -> dict[str, int]:
    """Each module -> the row of the layer table it is in (0: the bottom of the stack)."""
    rank: dict[str, int] = {}
    for row, (layer, cited, _owns) in enumerate(_table("## The layers and what each owns")):
        for path in re.findall(r"`([^`]+)`", cited):
            prefix = path.removesuffix(".py").removesuffix("/").replace("/", ".")
            prefix = prefix.removesuffix(".__init__")
            found = [m for m in MODULES
                     if m == prefix or (path.endswith("/") and m.startswith(prefix + "."))]
            assert found, f"the {layer} row cites {path}, which is no module of the package"
            for module in found:
                assert module not in rank, f"{module} is in two rows"
                rank[module] = row
    return rank


def _imports(module: str) -> set[str]:
    """The package's modules ``module`` imports, at the top or anywhere else."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:  # `from fxpipe import meta` imports a module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_module_is_in_exactly_one_layer() -> None:
    missing = sorted(set(MODULES) - set(_layers()))
    assert not missing, f"add these modules to design.md's layer table: {missing}"


def _upward() -> list[str]:
    """Each import of a module from a layer beneath it, as ``a -> b``."""
    rank = _layers()
    return [f"{a} -> {b}" for a, targets in sorted(GRAPH.items()) for b in sorted(targets)
            if rank[b] > rank[a]]


def test_no_module_imports_from_a_layer_beneath_it() -> None:
    upward = _upward()
    assert not upward, upward


def test_codegen_and_report_read_the_plan_not_the_solver_nor_each_other() -> None:
    def under(module: str, *layers: str) -> bool:
        return any(module == f"fxpipe.{x}" or module.startswith(f"fxpipe.{x}.") for x in layers)

    for module, targets in sorted(GRAPH.items()):
        if under(module, "codegen", "report"):
            other = "report" if under(module, "codegen") else "codegen"
            reached = [t for t in targets if under(t, "partition", "lower", other)]
            assert not reached, (module, reached)


def test_the_runtime_imports_nothing_of_fxpipe_beyond_itself() -> None:
    for module, targets in GRAPH.items():
        if module.startswith("fxpipe.runtime"):
            assert all(t.startswith("fxpipe.runtime") for t in targets), (module, targets)


def _circles() -> list[str]:
    """An import circle for each import that closes one in a depth-first walk of the graph
    (none: the graph is acyclic), as ``a -> b -> a``."""
    circles: list[str] = []
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    return circles


def test_there_is_no_import_circle() -> None:
    circles = _circles()
    assert not circles, circles


def test_a_circle_and_an_upward_import_would_be_found(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """The two checks above see what they look for: a made-up import of the driver by the
    units module is both a circle and an upward arrow."""
    monkeypatch.setitem(GRAPH, "fxpipe.units", {*GRAPH["fxpipe.units"], "fxpipe.compiler"})
    circles = _circles()  # every circle goes through the one import added
    assert circles and all("fxpipe.units -> fxpipe.compiler" in c for c in circles)
    assert "fxpipe.units -> fxpipe.compiler" in _upward()


def test_the_solver_loads_no_torch() -> None:
    code = "import sys, fxpipe.partition; print('torch' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=ROOT)
    assert found.stdout.strip() == "False"


def test_every_file_and_name_the_home_table_cites_exists() -> None:
    """A path in a row of "Where each idea lives" is a file or folder of the repository
    (relative to it, or to fxpipe/); the names in parentheses right after a path, and
    "`name` in `path`", are defined at the top of that module (or in a class in it)."""
    rows = _table("## Where each idea lives")
    assert len(rows) >= 10
    for idea, home in rows:
        for path in re.findall(r"`([\w/]+(?:\.py|/))`", home):
            assert _file(path) is not None, f"{idea!r} cites {path}, which does not exist"
        cited = [(path, names) for path, names in
                 re.findall(r"`([\w/]+\.py)` \(((?:`\w+`(?:, |; |\)|$))+)", home)]
        cited += [(path, f"`{name}`") for name, path in
                  re.findall(r"`(\w+)` in `([\w/]+\.py)`", home)]
        for path, names in cited:
            defined = _defined(_file(path))
            for name in re.findall(r"`(\w+)`", names):
                assert name in defined, f"{idea!r}: {path} defines no {name}"


def _file(path: str) -> Path | None:
    for base in (ROOT, PACKAGE, PACKAGE.parent):
        if (base / path).exists():
            return base / path
    return None


def _defined(path: Path | None) -> set[str]:
    assert path is not None
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


if __name__ == "__main__":
    imports = sum(len(targets) for targets in GRAPH.values())
    circles, upward = _circles(), _upward()
    print(f"{len(MODULES)} modules, {imports} imports between them, {len(circles)} circles, "
          f"{len(upward)} upward imports")
    for line in [*circles, *upward]:
        print(f"  {line}")
    sys.exit(1 if circles or upward else 0)
