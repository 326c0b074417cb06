"""Every user-facing error in docs/errors.md's table, reproduced: the printed line is the row's.

Each case builds its situation in an empty folder (the model file is always `model.py`),
runs the real `fxpipe` command there, and requires the one-line message it prints to
appear verbatim in docs/errors.md, so the table and the tool cannot drift apart.
"""

from __future__ import annotations

import os
import stat
import textwrap
from pathlib import Path

import pytest
import torch

from fxpipe import cli

ERRORS = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()

GOOD = """
import torch


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def example_inputs():
    return (torch.ones(4, 8),)
"""

# a Sequential that writes in place into both its linears' outputs: every output selective
# recompute could keep
WRITES = """
class Writes(torch.nn.Sequential):
    def forward(self, x):
        h = self[0](x)
        h.add_(1)
        h = self[2](self[1](h))
        h.add_(1)
        return h
"""

# eight 256 x 256 layers: about 1 MiB each with gradients and Adam's state
DEEP = """
import torch


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])


def example_inputs():
    return (torch.ones(4, 256),)
"""

# eight 64-wide layers on 2,048 rows: activations, which bfloat16 halves, dominate
WIDE = """
import torch


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                 for _ in range(8)])


def example_inputs():
    return (torch.ones(2048, 64),)
"""

# a hundred of WIDE's layers: stage 0 of n keeps n micro-batches of at least one of them
LONG = WIDE.replace("range(8)", "range(100)")


TIED = """
import torch


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


    def forward(self, tokens):
        return self.head(torch.relu(self.body(self.embed(tokens))))


def build_model():
    return Tied()


def example_inputs():
    return (torch.zeros(4, 3, dtype=torch.long),)
"""


def model(body: str) -> dict[str, str]:
    return {"model.py": textwrap.dedent(body)}


CASES: dict[str, tuple[dict[str, str], list[str]]] = {
    "missing file": ({}, ["profile", "model.py"]),
    "syntax error": (model("def build_model(:\n    pass\n"), ["profile", "model.py"]),
    "import fails": (model("import no_such_module_here\n"), ["profile", "model.py"]),
    "no build_model": (model("def example_inputs():\n    return ()\n"), ["profile", "model.py"]),
    "named factory missing": (model(GOOD), ["profile", "model.py:make_big"]),
    "factory raises": (
        model(GOOD.replace("    torch.manual_seed(0)\n", "    raise RuntimeError('no GPU')\n")),
        ["profile", "model.py"],
    ),
    "factory returns no module": (
        model("def build_model():\n    return 3\n"), ["profile", "model.py"]
    ),
    "no example_inputs": (
        model(GOOD.split("def example_inputs")[0]), ["profile", "model.py"]
    ),
    "inputs of the wrong type": (
        model(GOOD.replace("return (torch.ones(4, 8),)", "return 'tokens'")),
        ["profile", "model.py"],
    ),
    "inputs whose batch dimension is unclear": (
        model(
            """
            import torch


            class Positions(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.embed = torch.nn.Embedding(4, 8)

                def forward(self, x, position_ids):
                    return x + self.embed(position_ids)


            def build_model():
                return Positions()


            def example_inputs():
                return torch.ones(1, 4, 8), torch.arange(4).unsqueeze(0)
            """
        ),
        ["profile", "model.py"],
    ),
    "model neither tracer captures": (
        model(
            """
            import torch


            class Loop(torch.nn.Module):
                def forward(self, x):
                    for _ in range(int(x.sum().item())):
                        x = x * 2
                    return x


            def build_model():
                return Loop()


            def example_inputs():
                return (torch.ones(1),)
            """
        ),
        ["profile", "model.py"],
    ),
    "model that changes its tensors while it runs": (
        model(
            """
            import torch


            class Clamped(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.lin = torch.nn.Linear(4, 4)

                def forward(self, x):
                    if x.shape[0] > 0:  # a branch: symbolic_trace fails, export is tried
                        self.lin.weight.data.clamp_(-1, 1)
                    return self.lin(x)


            def build_model():
                return Clamped()


            def example_inputs():
                return (torch.ones(2, 4),)
            """
        ),
        ["profile", "model.py"],
    ),
    "model that casts its modules while it runs": (
        model(
            """
            import torch


            class Cast(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.lin = torch.nn.Linear(4, 4)

                def forward(self, x):
                    if x.shape[0] > 0:
                        self.lin = self.lin.to(torch.float64)
                    return self.lin(x.double())


            def build_model():
                return Cast()


            def example_inputs():
                return (torch.ones(2, 4),)
            """
        ),
        ["profile", "model.py"],
    ),
    "a tensor sized by the data": (
        model(
            """
            import torch


            class Picked(torch.nn.Module):
                def forward(self, x):
                    if x.shape[0] == 0:  # torch.export, not symbolic_trace
                        return x
                    return x[x > 0].sum() + x


            def build_model():
                return Picked()


            def example_inputs():
                return (torch.ones(4, 8),)
            """
        ),
        ["split", "model.py", "--gpus", "2"],
    ),
    "selective recompute under a schedule that splits the backward": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--schedule", "zb1p",
                      "--recompute", "selective"]),
    "selective recompute on a model that writes into a matmul's output": (
        model(GOOD.replace("return torch.nn.Sequential(", "return Writes(").replace(
            "def build_model():", WRITES + "\n\ndef build_model():")),
        ["split", "model.py", "--gpus", "2", "--recompute", "selective"]),
    "unknown device": (model(GOOD), ["split", "model.py", "--gpus", "2", "--device", "h900"]),
    "malformed --memory": (model(GOOD), ["split", "model.py", "--gpus", "2", "--memory", "lots"]),
    "--gpus below 1": (model(GOOD), ["split", "model.py", "--gpus", "0"]),
    "--microbatches below 1": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--microbatches", "0"]
    ),
    "--virtual-stages below 1": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--virtual-stages", "0"]
    ),
    "interleaved without virtual stages": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--schedule", "interleaved"]
    ),
    "virtual stages with another schedule": (
        model(GOOD),
        ["split", "model.py", "--gpus", "2", "--virtual-stages", "2", "--schedule", "gpipe"],
    ),
    "--replicate with --virtual-stages": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--virtual-stages", "2", "--replicate"]
    ),
    "interleaved micro-batches not a multiple of the GPUs": (
        model(GOOD),
        ["split", "model.py", "--gpus", "2", "--virtual-stages", "2", "--microbatches", "3"],
    ),
    "--pp not dividing --gpus": (model(GOOD), ["split", "model.py", "--gpus", "4", "--pp", "3"]),
    "--tp not dividing a host": (model(GOOD), ["split", "model.py", "--gpus", "4", "--tp", "3"]),
    "--dp-mode ddp with stages split over GPUs": (
        model(GOOD),
        ["split", "model.py", "--gpus", "4", "--pp", "1", "--tp", "2", "--dp-mode", "ddp"],
    ),
    "--microbatches disagreeing with --global-batch": (
        model(GOOD),
        ["split", "model.py", "--gpus", "2", "--microbatches", "3", "--global-batch", "8"],
    ),
    "more GPUs than ops": (model(GOOD), ["split", "model.py", "--gpus", "8", "--pp", "8"]),
    "more stage modules than ops": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--pp", "2", "--virtual-stages", "2"]
    ),
    "memory no split fits": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--memory", "100B"]
    ),
    "memory fits on more GPUs": (
        model(DEEP), ["split", "model.py", "--gpus", "2", "--memory", "3MiB"]
    ),
    "memory fits at a leaner precision": (
        model(WIDE), ["split", "model.py", "--gpus", "2", "--memory", "5MiB"]
    ),
    "memory fits under 1F1B": (
        model(WIDE), ["split", "model.py", "--gpus", "2", "--memory", "8MiB", "--schedule",
                      "gpipe"]
    ),
    "memory fits on smaller micro-batches": (
        model(WIDE), ["split", "model.py", "--gpus", "2", "--memory", "2MiB"]
    ),
    "memory fits on no GPU count searched": (
        model(LONG), ["split", "model.py", "--gpus", "2", "--memory", "3MiB"]
    ),
    "--out is someone else's folder": (
        {**model(GOOD), "out/notes.txt": "mine"},
        ["split", "model.py", "--gpus", "2", "--out", "out"],
    ),
    "model file calls sys.exit": (
        model("import sys\n\nsys.exit(0)\n"), ["split", "model.py", "--gpus", "2"]
    ),
    "inputs of the wrong shape": (
        model(GOOD.replace("torch.ones(4, 8)", "torch.ones(4, 7)")), ["profile", "model.py"]
    ),
    "a model with no ops": (
        model(GOOD.replace("torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), "
                           "torch.nn.Linear(8, 2))", "torch.nn.Identity()")),
        ["split", "model.py", "--gpus", "2"],
    ),
    "more ops than the solver handles (limit lowered to 2 in the test)": (
        model(GOOD), ["split", "model.py", "--gpus", "2"]
    ),
    "--microbatches absurdly high": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--microbatches", "1000000000"]
    ),
    "--time-limit not a positive number": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--time-limit", "nan"]
    ),
    "a flag fxpipe does not know": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--nodes", "2"]
    ),
    "--out is the current folder": (
        model(GOOD), ["split", "model.py", "--gpus", "2", "--out", ".", "--force"]
    ),
    "pipedream with a tied parameter": (
        model(TIED), ["split", "model.py", "--gpus", "2", "--pp", "2", "--schedule", "pipedream"]
    ),
    "merge: missing stage file": ({}, ["merge", "stage0.pt", "--out", "model.pt"]),
    "merge: copies of a key differ": (
        {"stage0.pt": "zeros", "stage1.pt": "ones"},
        ["merge", "stage0.pt", "stage1.pt", "--out", "model.pt"],
    ),
    "merge: --out is a folder": (
        {"stage0.pt": "zeros", "ckpt/keep.txt": ""}, ["merge", "stage0.pt", "--out", "ckpt"],
    ),
    "merge: a stage missing from the plan's": (
        {**model(GOOD), "out/plan.json": "split", "stage0.pt": "keys:0.weight,0.bias"},
        ["merge", "stage0.pt", "--out", "model.pt", "--plan", "out"],
    ),
    "merge: a file that is not the plan's stage": (
        {**model(GOOD), "out/plan.json": "split", "stage0.pt": "zeros", "stage1.pt": "zeros"},
        ["merge", "stage0.pt", "stage1.pt", "--out", "model.pt", "--plan", "out"],
    ),
    "merge: a key no stage of the plan holds": (
        {**model(GOOD), "out/plan.json": "split", "stage0.pt": "keys:0.weight,0.bias,step",
         "stage1.pt": "keys:2.weight,2.bias"},
        ["merge", "stage0.pt", "stage1.pt", "--out", "model.pt", "--plan", "out"],
    ),
    # /sys refuses new files, to root too
    "merge: --out where nothing can be written": (
        {"stage0.pt": "zeros"}, ["merge", "stage0.pt", "--out", "/sys/fxpipe-model.pt"],
    ),
}


def materialize(folder: Path, files: dict[str, str]) -> None:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".pt") and content.startswith("keys:"):  # a stage's own keys
            torch.save({key: torch.zeros(1) for key in content[5:].split(",")}, path)
        elif name.endswith(".pt"):  # a stage checkpoint holding one shared key
            fill = torch.zeros if content == "zeros" else torch.ones
            torch.save({"shared.weight": fill(2)}, path)
        elif content == "split":  # the folder fxpipe split writes for model.py on 2 GPUs
            assert cli.main(["split", str(folder / "model.py"), "--gpus", "2", "--pp", "2",
                             "--out", str(path.parent), "--force"]) == 0
        else:
            path.write_text(content)


def printed_error(folder: Path, argv: list[str], capsys: pytest.CaptureFixture[str],
                  monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(folder)
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("case", list(CASES))
def test_each_error_is_one_line_exit_2_and_in_the_readme(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files, argv = CASES[case]
    materialize(tmp_path, files)
    capsys.readouterr()  # what a split made for the case printed
    if case.startswith("more ops than the solver handles"):
        # The real limit takes a 20,000-op model, minutes to trace on a small machine.
        monkeypatch.setattr("fxpipe.partition.solve.MAX_NODES", 2)
    line = printed_error(tmp_path, argv, capsys, monkeypatch)
    assert line.startswith("fxpipe: error: ")
    row = f"| {case} | `{line.removeprefix('fxpipe: error: ')}` |"
    assert row in ERRORS, f"docs/errors.md lacks the row:\n{row}"


def test_an_internal_error_is_one_line_exit_1_and_a_traceback_under_debug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("lifted_tensor_0")

    materialize(tmp_path, model(GOOD))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("fxpipe.compiler.generate", broken)
    monkeypatch.delenv("FXPIPE_DEBUG", raising=False)
    assert cli.main(["split", "model.py", "--gpus", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fxpipe: internal error: KeyError: 'lifted_tensor_0'; this is a bug in "
                   "fxpipe, not in your model: please report it with the traceback "
                   "FXPIPE_DEBUG=1 prints"]
    assert "fxpipe: internal error: ...; this is a bug in fxpipe" in " ".join(ERRORS.split())
    assert not (tmp_path / "fxpipe-out").exists()
    monkeypatch.setenv("FXPIPE_DEBUG", "1")
    with pytest.raises(KeyError, match="lifted_tensor_0"):
        cli.main(["split", "model.py", "--gpus", "2"])


def test_the_output_folder_honours_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mkdtemp makes the staging folder 0700; the folder fxpipe leaves is what mkdir makes.
    materialize(tmp_path, model(GOOD))
    monkeypatch.chdir(tmp_path)
    previous = os.umask(0o022)
    try:
        assert cli.main(["split", "model.py", "--gpus", "2", "--out", "out"]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
