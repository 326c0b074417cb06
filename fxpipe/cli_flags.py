"""The ``fxpipe`` command's arguments: each subcommand's flags, their help and defaults.

Checks that read several flags together (``--schedule`` with ``--virtual-stages``) and
the wording of errors stay with the commands in ``cli.py``; here is only what argparse
declares.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from fxpipe.schedules import KINDS

__all__ = ["UsageError", "parse", "parser"]

# The flags whose value may be left out, and what they mean bare: argparse gives such a
# flag the next word whatever it is, the model's path too (see ``parse``).
_BARE = {"--recompute": "full"}


class UsageError(ValueError):
    """The command line does not parse: one line and a pointer to --help."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; see '{self.prog} --help'")


def parser(runs: Mapping[str, Callable[[argparse.Namespace], int]]) -> argparse.ArgumentParser:
    """The command line; ``runs[command]`` becomes that command's ``run`` default."""
    command_line = _Parser(
        prog="fxpipe",
        description="A pipeline-parallelism compiler for PyTorch.",
    )
    commands = command_line.add_subparsers(title="commands", dest="command")
    _profile_arguments(commands.add_parser(
        "profile", help="trace a model and show what every module or op costs"))
    _split_arguments(commands.add_parser(
        "split", help="cut a model into pipeline stages and write them as a Python package"))
    _report_arguments(commands.add_parser(
        "report", help="a plan's predictions against what a training step measured"))
    _merge_arguments(commands.add_parser(
        "merge", help="merge the stages' saved state_dicts into one model checkpoint"))
    for name, command in commands.choices.items():
        command.set_defaults(run=runs[name])
    return command_line


def parse(command_line: argparse.ArgumentParser,
          argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """``command_line.parse_known_args(argv)``, but a bare flag written before the model
    (``split --recompute model.py --gpus 2``) no longer takes the model's path as its
    value: where the words do not parse so, the path goes back to the model."""
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        return command_line.parse_known_args(words)
    except UsageError:
        untangled = _bare_before_model(words)
        if untangled is None:
            raise
        return command_line.parse_known_args(untangled)


def _bare_before_model(words: list[str]) -> list[str] | None:
    """``words`` with the first optional-value flag followed by a model path given its bare
    value (``--recompute=all``, say), or None where no such flag took a path."""
    for i, (word, value) in enumerate(itertools.pairwise(words)):
        flag = next((f for f in _BARE if len(word) > 4 and f.startswith(word)), None)
        if flag is not None and (value.endswith(".py") or ".py:" in value):
            return [*words[:i], f"{flag}={_BARE[flag]}", *words[i + 1:]]
    return None


def _profile_arguments(parser: argparse.ArgumentParser) -> None:
    _model_argument(parser)
    parser.add_argument("--device", default="h100", help="device table entry (default h100)")
    _precision_argument(parser)
    parser.add_argument("--by", choices=("module", "op"), default="module")
    parser.add_argument("--depth", type=int, default=None, help="module nesting level to show")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="time every node on this machine (CUDA events on a GPU, wall clock on the CPU)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _split_arguments(parser: argparse.ArgumentParser) -> None:
    _model_argument(parser)
    parser.add_argument(
        "--gpus", type=int, required=True,
        help="the GPUs to train on, all of them: the search lays them out as pipeline stages "
        "x data-parallel pipelines (--pp, --dp-mode, --tp pin parts of it)")
    parser.add_argument(
        "--memory", default=None, help="memory per GPU, e.g. 80GiB (default: the device's)"
    )
    parser.add_argument("--device", default="h100", help="device table entry (default h100)")
    _schedule_arguments(parser)
    _cluster_arguments(parser)
    _precision_argument(parser)
    parser.add_argument("--optimizer", choices=("adam", "sgd", "sgd-momentum"), default="adam")
    parser.add_argument(
        "--recompute",
        nargs="?",
        const=_BARE["--recompute"],
        default="auto",
        metavar="{auto,full,selective,none}",
        help="stages that keep less than their backward reads and recompute it in the "
        "backward: auto (default: the solver chooses none, selective at a keep level, or "
        "full per stage), full (also a bare --recompute, or all), selective (each keeps "
        "its matmuls' and attention's outputs), none",
    )
    parser.add_argument(
        "--work-limit", type=float, default=10.0,
        help="solver work in CP-SAT deterministic time (about seconds on a quiet machine); "
        "the same model and flags give the same plan at any machine load")
    parser.add_argument(
        "--time-limit", type=float, default=120.0,
        help="wall-clock safety net in seconds; when it stops the solver first, the plan "
        "says so and may differ run to run")
    parser.add_argument("--diagram", choices=("module", "op"), default="module")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="time every node on this machine instead of the roofline",
    )
    parser.add_argument(
        "--calibrate",
        metavar="MEASURED.json",
        default=None,
        help="re-plan with the stage times a training step measured (runner.measure); "
        "the plan it measured is the plan.json beside it",
    )
    parser.add_argument("--out", default="fxpipe-out",
                        help="output folder (default fxpipe-out); where it is a symbolic link, "
                        "the folder it points to")
    parser.add_argument(
        "--force", action="store_true", help="replace --out even if fxpipe did not write it"
    )


def _schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """``split``'s flags for the pipeline schedule: micro-batches, kind, stage placement."""
    parser.add_argument(
        "--microbatches", type=int, default=None, help="micro-batches per step (default 4 x GPUs)"
    )
    parser.add_argument(
        "--schedule",
        choices=tuple(kind.value for kind in KINDS),
        default=None,
        help="pipeline schedule (default 1f1b; interleaved with --virtual-stages; pipedream: "
        "1F1B with an update per micro-batch and weight stashing; zb1p, zbv, dualpipev: "
        "zero bubble, the backward split into input and weight gradients, zbv and dualpipev "
        "with two stage modules per GPU in a V)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        help="stage modules per GPU for Megatron-LM's interleaved 1F1B (default 1)",
    )
    parser.add_argument(
        "--replicate",
        action="store_true",
        help="let a stage run data-parallel on several GPUs (PipeDream's 2-1-1)",
    )


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``split``'s flags for the cluster: the layout of the --gpus (pipeline stages times
    data-parallel pipelines times tensor-parallel GPUs) is searched, each flag pinning a
    part of it."""
    parser.add_argument(
        "--pp", default=None, metavar="{auto,P}",
        help="GPUs per pipeline, the rest data-parallel pipelines (default auto: the search "
        "tries every P dividing --gpus; --pp equal to --gpus plans one pipeline on all of "
        "them)")
    parser.add_argument(
        "--gpus-per-node", type=int, default=None,
        help="GPUs per host, joined by the device's intra-node link (default 8, or --gpus "
        "when fewer); hosts are joined by its inter-node link")
    parser.add_argument(
        "--dp-mode", choices=("fsdp", "ddp"), default=None,
        help="how the pipelines keep each stage's copies equal: fsdp (torch's FSDP2, the "
        "optimizer state sharded) or ddp (default: the search chooses)")
    parser.add_argument(
        "--global-batch", type=int, default=None, metavar="SAMPLES",
        help="samples per step over all pipelines (default: --microbatches micro-batches "
        "of the example's samples)")
    parser.add_argument(
        "--tp", default=None, metavar="{auto,T}",
        help="GPUs of a host that split each stage's matmuls, attention heads and "
        "vocabulary (Megatron-LM's tensor parallelism): auto searches every T dividing "
        "--gpus-per-node and the heads (default 1: none)")


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_dir", metavar="PLAN_DIR", help="folder fxpipe split wrote")
    parser.add_argument("measured", metavar="MEASURED.json",
                        help="the report card runner.measure(...) saved")
    parser.add_argument("--model", default=None,
                        help="the model file the plan was made from: re-plan it with the "
                        "measurements and say whether a cut moves (nothing is written)")


def _merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stages", nargs="+", help="torch.save'd stage state_dicts, in stage order")
    parser.add_argument("--out", required=True, help="path of the merged checkpoint")
    parser.add_argument("--plan", default=None, metavar="DIR",
                        help="the folder fxpipe split wrote: check that the files are every "
                        "stage of its plan, in order")


def _model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="model file defining build_model() and example_inputs(); FILE.py:FACTORY"
    )


def _precision_argument(parser: argparse.ArgumentParser) -> None:
    # Checked by fxpipe.precision.parse_precision (a one-line error), not by argparse choices.
    parser.add_argument(
        "--precision",
        default=None,
        help="32-true, bf16-mixed, bf16-true, 16-mixed or 16-true, as Lightning names them "
        "(default: the model's parameter dtype)",
    )
