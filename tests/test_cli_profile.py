"""``fxpipe profile`` as the command runs (in this process, see ``tests/_cli.py``): bad
model files fail with one clear line and exit code 2; good ones print a table or JSON."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests._cli import Ran, fxpipe_process
from tests._cli import fxpipe as run_in_process

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"

MODEL = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
{forward}
"""
INPUTS = "\ndef example_inputs():\n    return (torch.ones(2, 4),)\n"
BUILD = "\ndef build_model():\n    return M()\n"


def fxpipe(*args: str | Path) -> Ran:
    return run_in_process("profile", *args, cwd=ROOT)


def model_file(tmp_path: Path, text: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def model_with_forward(body: str) -> str:
    return MODEL.format(forward=textwrap.indent(textwrap.dedent(body), " " * 8)) + BUILD + INPUTS


def user_error(result: Ran) -> str:
    """The one error line of a failed run, after checking the failure is a clean one."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"stderr has {len(lines)} lines:\n{result.stderr}"
    assert lines[0].startswith("fxpipe: error: "), lines[0]
    return lines[0]


def test_missing_file(tmp_path: Path) -> None:
    line = user_error(fxpipe(tmp_path / "nope.py"))
    assert "nope.py" in line and "no such file" in line and "build_model()" in line


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = model_file(tmp_path, "import torch\n\ndef build_model(:\n    pass\n")
    line = user_error(fxpipe(path))
    assert f"{path}:3:" in line and "syntax error" in line and "fix the file" in line


def test_no_build_model(tmp_path: Path) -> None:
    path = model_file(tmp_path, MODEL.format(forward="        return x") + INPUTS)
    line = user_error(fxpipe(path))
    assert str(path) in line and "no function build_model()" in line
    assert "define build_model()" in line and ":NAME" in line


def test_factory_raising_names_file_line_and_exception(tmp_path: Path) -> None:
    text = MODEL.format(forward="        return x") + INPUTS
    text += "\ndef build_model():\n    raise RuntimeError('out of coffee')\n"
    path = model_file(tmp_path, text)
    raise_line = text.splitlines().index("    raise RuntimeError('out of coffee')") + 1
    line = user_error(fxpipe(path))
    assert f"{path}:{raise_line}:" in line
    assert "RuntimeError: out of coffee" in line and "fix build_model()" in line


def test_no_example_inputs(tmp_path: Path) -> None:
    path = model_file(tmp_path, MODEL.format(forward="        return x") + BUILD)
    line = user_error(fxpipe(path))
    assert str(path) in line and "no function example_inputs()" in line
    assert "define example_inputs()" in line


@pytest.mark.parametrize("value", ["'tokens'", "3"])
def test_example_inputs_of_wrong_type(tmp_path: Path, value: str) -> None:
    text = MODEL.format(forward="        return x") + BUILD
    text += f"\ndef example_inputs():\n    return {value}\n"
    path = model_file(tmp_path, text)
    line = user_error(fxpipe(path))
    kind = "str" if value.startswith("'") else "int"
    assert str(path) in line and f"example_inputs() returned {kind}" in line
    assert "return a tuple" in line and "dict" in line


def test_factory_named_after_colon_is_missing(tmp_path: Path) -> None:
    path = model_file(tmp_path, MODEL.format(forward="        return x") + BUILD + INPUTS)
    line = user_error(fxpipe(f"{path}:make_big"))
    assert str(path) in line and "no function make_big()" in line and "after the ':'" in line


def test_unknown_device(tmp_path: Path) -> None:
    line = user_error(fxpipe(GPT, "--device", "tpu9"))
    assert "'tpu9'" in line and "h100" in line  # what is wrong and what to pass instead


UNTRACEABLE = {
    # a loop count read out of a tensor's value
    "item_range": """
        n = int(x.sum().item())
        for _ in range(n):
            x = self.lin(x)
        return x
    """,
    # a branch on a tensor's value
    "if_tensor": """
        if x.sum() > 0:
            return self.lin(x)
        return x
    """,
    # leaving torch for numpy
    "numpy": """
        return self.lin(torch.from_numpy(x.detach().numpy() * 2))
    """,
}


@pytest.mark.parametrize("forward", UNTRACEABLE.values(), ids=list(UNTRACEABLE))
def test_untraceable_model_is_reported_not_crashed(tmp_path: Path, forward: str) -> None:
    """Neither symbolic_trace nor torch.export captures these: exit 2, no traceback."""
    result = fxpipe(model_file(tmp_path, model_with_forward(forward)))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("fxpipe: error: ") and "cannot trace M: torch.export failed" in last
    assert "torch.export failed" in last and "data-dependent" in last


def test_untraceable_model_error_is_one_line_with_file_and_line(tmp_path: Path) -> None:
    path = model_file(tmp_path, model_with_forward(UNTRACEABLE["item_range"]))
    line = user_error(fxpipe(path))
    assert f"{path}:" in line


def test_untraceable_library_line_is_named_with_its_code(tmp_path: Path) -> None:
    """Where export fails inside a library the model calls (transformers 5.17's OPT, BART
    and Whisper branch on a random draw in training: ``if dropout_probability <
    self.layerdrop``), the error names that file, line and code, not only the model file."""
    (tmp_path / "library.py").write_text(textwrap.dedent("""
        import torch

        def maybe_skip(layer, x):
            if torch.rand([]) + x.sum() < 0.0:
                return x
            return layer(x)
    """))
    path = model_file(tmp_path, model_with_forward("""
        import sys
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from library import maybe_skip
        return maybe_skip(self.lin, x)
    """))
    line = user_error(fxpipe(path))
    library = tmp_path / "library.py"
    assert line.endswith(f"(at {library}:5, `if torch.rand([]) + x.sum() < 0.0:`)")


def test_json_has_rows_and_total() -> None:
    result = fxpipe(GPT, "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["tracer"] == "symbolic_trace" and payload["by"] == "module"
    assert payload["rows"] and payload["total"]["flops_forward"] > 0
    assert sum(r["flops_forward"] for r in payload["rows"]) == payload["total"]["flops_forward"]
    assert {"name", "flops_backward", "param_bytes", "forward_s"} <= payload["total"].keys()


def test_by_op() -> None:
    result = fxpipe(GPT, "--by", "op", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    names = [r["name"] for r in payload["rows"]]
    assert payload["by"] == "op" and "Linear" in names
    flops = [r["flops_forward"] for r in payload["rows"]]
    assert flops == sorted(flops, reverse=True)

    table = fxpipe(GPT, "--by", "op")
    assert table.returncode == 0, table.stderr
    assert "Linear" in table.stdout and "total" in table.stdout


def test_table_prints_the_json_figures_in_the_shared_format() -> None:
    """The table and --json describe one analysis; every figure of the total row is the
    JSON value through fxpipe.units, the format split, report.md and the diagrams use."""
    from fxpipe.units import format_bytes, format_count, format_seconds

    total = json.loads(fxpipe(GPT, "--json").stdout)["total"]
    table = fxpipe(GPT)
    assert table.returncode == 0, table.stderr
    # on a pipe the progress goes nowhere and what the driver learnt goes to stdout
    assert "traced with symbolic_trace" in table.stdout
    row = next(line for line in table.stdout.splitlines() if "total" in line)
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[1:] == [
        str(total["nodes"]),
        format_count(total["flops_forward"]),
        format_count(total["flops_backward"]),
        format_bytes(total["param_bytes"]),
        format_bytes(total["activation_bytes"]),
        format_seconds(total["forward_s"]),
        format_seconds(total["backward_s"]),
    ]


def test_json_is_not_mixed_with_the_model_files_own_prints(tmp_path: Path) -> None:
    text = model_with_forward('        print("in forward")\n        return self.lin(x)')
    text = 'print("importing")\n' + text.replace("return M()", 'print("building")\n    return M()')
    # a new interpreter: the streams are the process's own
    result = fxpipe_process("profile", model_file(tmp_path, text), "--json", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rows"]
    assert all(word in result.stderr for word in ("importing", "building", "in forward"))
