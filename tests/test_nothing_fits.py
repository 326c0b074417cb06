"""When no split fits, the one-line answer says what would, and every fix it names is
true: the command run again with that fix (its flags replacing the same ones) plans.
What it says cannot fit does not: more GPUs, when an op alone is too big for one."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from fxpipe.cli import main
from tests.test_error_table import DEEP, WIDE

# eight 256-wide layers and a 256 -> 4096 head whose parameters and state alone (16 MiB
# in float32 with Adam) exceed the limits below: no number of GPUs holds it
HEADED = """
import torch


def build_model():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(8)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 4096))


def example_inputs():
    return (torch.ones(4, 256),)
"""


def _split(tmp_path: Path, model: Path, flags: list[str],
           capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["split", str(model), "--device", "h100", "--microbatches", "8",
                 "--out", str(tmp_path / "out"), "--force", *flags])
    return code, capsys.readouterr().err


def _fixes(message: str) -> list[list[str]]:
    """The flags of each fix the message names after "; use", e.g. --precision bf16-true
    --gpus 4 as one fix."""
    tail = message.split("; use ", 1)[1].rstrip()
    return [re.findall(r"--[a-z-]+|\S+", fix) for fix in re.split(r", | or ", tail)]


def _example_fix(fix: list[str]) -> tuple[int, int, str] | None:
    """(b, B, M) of a fix "an example of b samples (not B) with --microbatches M"."""
    match = re.fullmatch(r"an example of (\d+) samples \(not (\d+)\) with --microbatches "
                         r"(\d+)", " ".join(fix))
    return None if match is None else (int(match[1]), int(match[2]), match[3])


def _applied(tmp_path: Path, text: str, flags: list[str], fix: list[str]
             ) -> tuple[Path, list[str]]:
    """The model file and flags with ``fix`` applied: its flags set, or the example's
    batch of B rows cut to b."""
    example = _example_fix(fix)
    if example is None:
        return _model(tmp_path, text), _with(flags, fix)
    b, B, microbatches = example
    assert f"torch.ones({B}, " in text
    model = _model(tmp_path, text.replace(f"torch.ones({B}, ", f"torch.ones({b}, "))
    return model, [*flags, "--microbatches", microbatches]


def _with(flags: list[str], fix: list[str]) -> list[str]:
    """``flags`` with each flag of ``fix`` set to its value there."""
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    given.update(zip(fix[::2], fix[1::2], strict=True))
    return [part for pair in given.items() for part in pair]


def _model(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(("text", "flags", "named"), [
    # 2 GPUs: 4 pipeline stages hold the layers (the step's 32 samples kept), and
    # bf16-true halves their state
    (DEEP, ["--gpus", "2", "--memory", "3MiB"],
     ["--gpus 4 --pp 4 --global-batch 32", "--precision bf16-true"]),
    # one layer per GPU in float32; in bfloat16 two, but not on 2 GPUs
    (DEEP, ["--gpus", "2", "--memory", "1.5MiB"],
     ["--gpus 8 --pp 8 --global-batch 32",
      "--precision bf16-true --gpus 4 --pp 4 --global-batch 32"]),
    # --pp 2 kept: in bfloat16 its two stages fit as 4 FSDP pipelines, not as one of 4
    # stages (said "--gpus 4" before, which did not fit beside --pp 2) ...
    (DEEP, ["--gpus", "2", "--pp", "2", "--memory", "1.5MiB"],
     ["--precision bf16-true --gpus 8 --pp 2 --dp-mode fsdp --global-batch 32"]),
    # ... and in hosts of 4 (said "--gpus 6", which fills none)
    (DEEP, ["--gpus", "4", "--pp", "2", "--memory", "1.5MiB"],
     ["--precision bf16-true --gpus 8 --pp 2 --dp-mode fsdp --global-batch 32"]),
    # GPipe keeps all its micro-batches in flight: 4 FSDP pipelines of 2 stages share the
    # step's, and bf16-mixed halves the activations
    (WIDE, ["--gpus", "2", "--memory", "8MiB", "--schedule", "gpipe"],
     ["--gpus 8 --pp 2 --dp-mode fsdp --global-batch 16384", "--precision bf16-mixed"]),
])
def test_every_fix_named_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              text: str, flags: list[str], named: list[str]) -> None:
    model = _model(tmp_path, text)
    code, err = _split(tmp_path, model, flags, capsys)
    assert code == 2, err
    message = err.strip()
    assert message.count("\n") == 0 and message.startswith("fxpipe: error: no layout")
    fixes = _fixes(message)
    assert any(fix[0] == "--memory" for fix in fixes)
    for fix in named:
        assert fix.split() in fixes, message
    for fix in fixes:
        code, again = _split(tmp_path, *_applied(tmp_path, text, flags, fix), capsys)
        assert code == 0, (fix, again)


def test_smaller_micro_batches_are_named_the_largest_that_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """WIDE's activations dominate: at 2 MiB no GPU count holds its 2,048-row micro-batch
    (one layer alone needs more), but micro-batches of 256 rows fit, as many more of them
    as keep the rows per step; of 512 rows they do not."""
    flags = ["--gpus", "2", "--memory", "2MiB"]
    code, err = _split(tmp_path, _model(tmp_path, WIDE), flags, capsys)
    assert code == 2, err
    fix = next(f for f in _fixes(err.strip()) if _example_fix(f) is not None)
    assert _example_fix(fix) == (256, 2048, "64")  # 8 micro-batches of 2,048 rows before
    code, again = _split(tmp_path, *_applied(tmp_path, WIDE, flags, fix), capsys)
    assert code == 0, again
    larger = ["an", "example", "of", "512", "samples", "(not", "2048)", "with",
              "--microbatches", "32"]
    code, again = _split(tmp_path, *_applied(tmp_path, WIDE, flags, larger), capsys)
    assert code == 2 and "no layout" in again, again


def test_no_smaller_micro_batch_is_named_for_an_example_of_one_sample(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    single = WIDE.replace("torch.ones(2048, 64)", "torch.ones(1, 64)").replace(
        "torch.nn.Linear(64, 64)", "torch.nn.Linear(64, 4096), torch.nn.Linear(4096, 64)")
    code, err = _split(tmp_path, _model(tmp_path, single), ["--gpus", "2", "--memory", "1MiB"],
                       capsys)
    assert code == 2 and "no layout" in err, err
    assert "an example of" not in err


def test_an_op_too_big_for_one_gpu_rules_out_every_gpu_count(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model(tmp_path, HEADED)
    flags = ["--gpus", "2", "--memory", "12MiB"]
    code, err = _split(tmp_path, model, flags, capsys)
    assert code == 2, err
    assert "and op _8 of 8 alone needs" in err  # the head, the Sequential's ninth module
    assert "so no number of GPUs fits" in err
    assert "--gpus" not in err.split("; use ")[1].split("--precision")[0]  # no count named
    for gpus in ("4", "16"):  # proved, not searched: nor does any other count
        code, again = _split(tmp_path, model, _with(flags, ["--gpus", gpus]), capsys)
        assert code == 2 and "no layout" in again, again
    for fix in _fixes(err.strip()):
        code, again = _split(tmp_path, model, _with(flags, fix), capsys)
        assert code == 0, (fix, again)


def test_a_layouts_fix_never_names_one_pipelines_gpu_count_as_the_jobs() -> None:
    """The solver's "fits on 4 GPUs" for the leanest layout counts its pipeline's stages (at
    its d and M): the command line must not say "--gpus 4" for a job of 64 GPUs (it did,
    with --pp 2 --tp 8 on Llama-3-70B)."""
    from fxpipe import cli
    from fxpipe.cluster import NoLayoutFits
    from fxpipe.cost_models import get_device
    from fxpipe.options import SplitOptions
    from fxpipe.partition import InfeasibleMemoryError

    raw = InfeasibleMemoryError(devices=2, limit=80 * 2**30, needed=127.7 * 2**30, fits_on=4,
                                microbatches=64)
    options = SplitOptions(gpus=2, device=get_device("h100"), memory_limit=80 * 2**30,
                           microbatches=64, tensor_parallel=8)
    error = NoLayoutFits(64, 8, "2 pipeline stages x 4 data-parallel (fsdp)", raw, None,
                         options, 4, 1024, lambda precision: (None, 1024))
    worded = cli._worded(error)
    assert "--gpus" not in worded.split("; use ")[1], worded
    assert worded.endswith("; use --memory 127.7GiB"), worded
    assert "use 4 GPUs" not in str(error), str(error)


def test_no_layout_fits_crosses_processes(tmp_path: Path) -> None:
    """fxpipe.split in a multiprocessing pool (as bench/gpipe_transformer.py probes) raises
    NoLayoutFits in the parent, its figures kept; its search for a layout on more GPUs,
    which plans with the graph, stays behind."""
    import multiprocessing

    from fxpipe.cluster import NoLayoutFits

    model = _model(tmp_path, DEEP)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        result = pool.apply_async(_split_in_child, (str(model),))
        with pytest.raises(NoLayoutFits, match="no layout of 2 GPUs") as caught:
            result.get(timeout=120)
    assert caught.value.error.needed > caught.value.error.limit
    assert caught.value.fits_on is not None and caught.value.fewest is None


def _split_in_child(model: str) -> None:
    import fxpipe

    fxpipe.split_file(model, gpus=2, memory="1.5MiB", device="h100", microbatches=8)
