"""train_torchrun.py on what the user gives: a model file that raises, a checkpoint or
a batch file that is not what it should be, stops in one line per rank that says which
and where (no rank's traceback), with a non-zero exit; a batch or checkpoint file is
loaded as tensors and plain values only, so a pickle in it never runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from fxpipe.runtime import launch

from ._helpers import EXAMPLES, contiguous_plan, load, torchrun, write_package

MLP = (EXAMPLES / "mlp.py").read_text()


class _Payload:
    """Pickled, it runs ``touch marker`` when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("mlp")
    _, traced = load(str(EXAMPLES / "mlp.py"))
    write_package(directory / "pkg", traced, contiguous_plan(traced.gm.graph, 2, schedule="1f1b"))
    return directory / "pkg" / "train_torchrun.py"


def _errors(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The error lines, after checking that no rank printed a traceback."""
    output = (result.stdout + result.stderr).splitlines()
    assert result.returncode != 0, output
    assert not any(line.startswith("[rank") for line in output), output  # a rank's traceback
    return sorted(line for line in output if line.startswith("train_torchrun: error:"))


def test_a_model_file_that_raises_is_one_line_per_rank(package: Path, tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    lines = MLP.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("BATCH = ")) + 1
    model.write_text("\n".join([*lines[:at], 'raise OSError("no data server")', *lines[at:]]))
    why = (f"{model}:{at + 1}: importing the file raised OSError: no data server; fix the "
           "model file and run again")
    assert _errors(torchrun(2, package, "--model", str(model))) == [
        f"train_torchrun: error: rank {rank}: {why}" for rank in (0, 1)]


def test_a_loss_fn_that_raises_stops_the_last_rank_in_one_line(package: Path,
                                                             tmp_path: Path) -> None:
    """Only the last stage's rank runs the loss; the other stops in a line of its own
    (when it sees the closed connection before torchrun stops it)."""
    model = tmp_path / "model.py"
    model.write_text(MLP.replace("    return F.mse_loss(output, target)",
                                 '    return output["logits"].mean()'))
    at = model.read_text().splitlines().index('    return output["logits"].mean()') + 1
    errors = _errors(torchrun(2, package, "--model", str(model)))
    assert errors[-1] == (
        f"train_torchrun: error: rank 1: {model}:{at}: loss_fn raised IndexError: too many "
        "indices for tensor of dimension 2; fix the model file and run again"), errors
    assert errors[:-1] in ([], ["train_torchrun: error: rank 0: stopped: another rank failed "
                                "and closed its connection (see its error)"]), errors


def test_a_pickle_in_the_batch_file_is_refused_not_run(package: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    ids = torch.zeros(16, 64)
    torch.save({"args": (ids,), "kwargs": {}, "target": _Payload(marker)}, tmp_path / "b.pt")
    errors = _errors(torchrun(2, package, "--model", str(EXAMPLES / "mlp.py"), "--batch",
                              str(tmp_path / "b.pt")))
    assert not marker.exists()
    why = (f"--batch {tmp_path / 'b.pt'} holds more than tensors and plain values, or is no "
           "torch.save file, and was not loaded (torch.load with weights_only: Trying to load "
           "unsupported GLOBAL posix.system whose module posix is blocked.); save {'args': "
           "(...), 'kwargs': {...}, 'target': ...} of tensors and plain values with torch.save")
    assert errors == [f"train_torchrun: error: rank {rank}: {why}" for rank in (0, 1)]


# in one process: what the loaders refuse, each in one line
def test_batch_files_that_are_not_a_mini_batch(tmp_path: Path) -> None:
    path = tmp_path / "b.pt"
    marker = tmp_path / "ran"
    for saved, why in [
        ({"args": [torch.zeros(2)], "target": _Payload(marker)}, "holds more than tensors"),
        ([torch.zeros(2)], "holds a list, not a mini-batch"),
        ({"inputs": (torch.zeros(2),)}, r"holds a dict of \['inputs'\], not a mini-batch"),
        ({"args": torch.zeros(2)}, r"holds a dict of \['args'\], not a mini-batch"),
    ]:
        torch.save(saved, path)
        with pytest.raises(ValueError, match=f"^--batch {path} {why}"):
            launch._load_batch(str(path))
    assert not marker.exists()
    torch.save({"args": (torch.zeros(2),), "kwargs": {}}, path)  # no target: a model's own loss
    assert launch._load_batch(str(path))["target"] is None
    with pytest.raises(FileNotFoundError, match=f"--batch {tmp_path / 'none.pt'} not found"):
        launch._load_batch(str(tmp_path / "none.pt"))


def test_checkpoints_that_are_not_a_state_dict(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=f"^--checkpoint {path} holds more than tensors and "
                       r"plain values, or is no torch.save file, and was not loaded \(torch.load"):
        launch._load_checkpoint(str(path))
    torch.save({"w": torch.zeros(2), "step": 3}, path)
    with pytest.raises(ValueError, match=f"^--checkpoint {path} holds a dict, not a state_dict "
                       "of tensors; give the torch.save'd state_dict of the whole model"):
        launch._load_checkpoint(str(path))


@pytest.mark.parametrize("said", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
    "[127.0.0.1]:29500",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:40612: "
    "Connection reset by peer",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:601] Write error: Broken pipe",
    "NCCL error: remote process exited or there was a network error",
])
def test_what_a_collective_says_when_a_peer_exits_is_the_peers_failure(said: str) -> None:
    """A rank that loses its peer stops in its one line, not a traceback, however gloo
    words it: a write racing the peer's exit under load gives a reset or a broken pipe
    (the loss test above printed rank 0's traceback once in a loaded CI run)."""
    assert launch.peer_failed(RuntimeError(said))


def test_a_rank_of_its_own_fault_is_not_taken_for_a_peers() -> None:
    assert not launch.peer_failed(RuntimeError("CUDA out of memory"))
