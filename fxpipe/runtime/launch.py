"""The torchrun entry point of a generated package: join the job, build this
rank's stages, and train N steps of the model file's ``loss_fn``.

    torchrun --nproc-per-node N train_torchrun.py --model model.py [--checkpoint model.pt]

gloo on the CPU, NCCL on GPUs (one GPU per local rank). What the user gives (the model
file and what it raises, --checkpoint, --batch) fails in one line per rank, without a
traceback; a file is loaded without running code in it (``weights_only``).
"""

import argparse
import contextlib
import inspect
import os
import resource
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from .adapter import check_feed
from .data_parallel import held_bytes, watch_step, whole
from .loading import import_file
from .materialize import parameters_on_meta
from .microbatch import shared_leaves
from .pipelining import DistributedPipeline
from .rank_measure import measure_ranks
from .tensor_parallel import unfused
from .torch_zero_bubble import ZERO_BUBBLE, requirement

__all__ = ["init_distributed", "main", "peak_rss_bytes", "peer_failed"]


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the torchrun job: (rank, world size, this rank's device). gloo on the
    CPU, NCCL on GPUs (one GPU per local rank)."""
    rank, world_size = _launched()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"))
    return rank, world_size, device


def _launched() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; RuntimeError saying how, where it did not."""
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"not launched under torchrun ({' and '.join(missing)} unset): run "
            "`torchrun --nproc-per-node N train_torchrun.py ...` with N the plan's GPUs"
        )
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _load_model_file(spec: str) -> tuple[Any, Callable[[], nn.Module]]:
    """``model.py`` or ``model.py:factory``: the imported file and its factory."""
    path, _, factory = spec.partition(":")
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"model file {path} not found")
    with _raised_by(path, "importing the file"):
        module = import_file(file, f"_model_{file.stem}")
    build = getattr(module, factory or "build_model", None)
    if build is None:
        raise ValueError(f"{path} has no factory {factory or 'build_model'}()")
    return module, build


def _from_file(module: Any, build: Any, name: str) -> Callable[..., Any] | None:
    """The model file's function ``name``: the factory's own attribute, else the file's."""
    function = getattr(build, name, None)
    return function if callable(function) else getattr(module, name, None)


@contextlib.contextmanager
def _raised_by(path: str, what: str) -> Iterator[None]:
    """Whatever the model file raises in ``what`` as one line naming the file's line."""
    try:
        yield
    except (Exception, SystemExit) as error:
        raise ValueError(f"{_where(path, error)}: {what} raised {_one_line(error)}; fix the "
                         "model file and run again") from None


def _where(path: str, error: BaseException) -> str:
    """``path:line`` of the innermost frame in the file ``path`` (or of its syntax error)."""
    file = Path(path).resolve()
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if Path(frame.filename).resolve() == file]
    if isinstance(error, SyntaxError) and error.filename and Path(error.filename) == file:
        lines.append(error.lineno)
    return f"{path}:{lines[-1]}" if lines and lines[-1] else path


def _one_line(error: BaseException) -> str:
    """``Type: first line of the message``."""
    text = (error.msg if isinstance(error, SyntaxError) else str(error)).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _load(path: str, what: str, fix: str, *, mmap: bool = False) -> Any:
    """``torch.load`` of a file the user gives, tensors and plain values only: a pickle
    that would run code (or import anything) is refused in one line, with ``fix``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what} {path} not found")
    try:
        with warnings.catch_warnings():  # torch warns of pickles before it refuses them
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        why = next((line for line in lines if "unsupported" in line.lower()),
                   lines[0] if lines else type(error).__name__)
        raise ValueError(f"{what} {path} holds more than tensors and plain values, or is no "
                         f"torch.save file, and was not loaded (torch.load with weights_only: "
                         f"{why}); {fix}") from None


def _load_batch(path: str) -> dict[str, Any]:
    """The --batch file: ``{'args': tuple, 'kwargs': dict, 'target': ...}`` (a model that
    computes its own loss may leave the target out)."""
    fix = ("save {'args': (...), 'kwargs': {...}, 'target': ...} of tensors and plain values "
           "with torch.save")
    batch = _load(path, "--batch", fix)
    if not (isinstance(batch, dict) and {"args", "kwargs"} & batch.keys()
            and batch.keys() <= {"args", "kwargs", "target"}
            and isinstance(batch.get("args", ()), (tuple, list))
            and isinstance(batch.get("kwargs", {}), dict)):
        what = (f"a dict of {sorted(map(str, batch))}" if isinstance(batch, dict)
                else f"a {type(batch).__name__}")
        raise ValueError(f"--batch {path} holds {what}, not a mini-batch; {fix}")
    return {"args": tuple(batch.get("args", ())), "kwargs": batch.get("kwargs", {}),
            "target": batch.get("target")}


def _load_checkpoint(path: str) -> Mapping[str, torch.Tensor]:
    """The --checkpoint file: a state_dict, memory-mapped."""
    fix = "give the torch.save'd state_dict of the whole model (fxpipe merge writes one)"
    state = _load(path, "--checkpoint", fix, mmap=True)
    if not isinstance(state, Mapping) or not all(
            isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"--checkpoint {path} holds a {type(state).__name__}, not a "
                         f"state_dict of tensors; {fix}")
    return state


def main(pipeline: DistributedPipeline, argv: Sequence[str] | None = None) -> int:
    """The launch script: N training steps of the model file's loss_fn under torchrun."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", required=True, help="model.py or model.py:factory")
    parser.add_argument("--checkpoint", help="torch.save'd state_dict of the whole model; "
                        "without it every rank builds the model for real")
    parser.add_argument("--batch", help="torch.save'd {'args', 'kwargs', 'target'} mini-batch, "
                        "the global one under a data-parallel layout (pipeline i trains rows "
                        "[i·B/d, (i+1)·B/d)); default: the example micro-batch repeated M "
                        "(d · M) times (its inputs without a batch dimension once)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--clip-grad-norm", type=float, metavar="X",
                        help="clip the whole model's gradient norm to X every step")
    parser.add_argument("--save", help="directory for rank{k}.pt: loss, grads (whole, gathered "
                        "over a data-parallel layout's shards), the bytes held (memory), peak "
                        "RSS and (the last stage's ranks) the model's output per micro-batch")
    parser.add_argument("--measure", metavar="FILE",
                        help="time every step after the first and write the report card "
                        "(measured.json, for fxpipe report) to FILE")
    opts = parser.parse_args(argv)
    if opts.measure and opts.steps < 2:
        print(f"train_torchrun: error: --measure times the steps after the first (a warm-up); "
              f"use --steps 2 or more, got {opts.steps}", file=sys.stderr)
        return 2

    try:
        rank, _ = _launched()
    except RuntimeError as error:
        print(f"train_torchrun: error: {error}", file=sys.stderr)
        return 2
    try:  # before joining: a file that does not load fails alone on every rank, not on
        loaded = _load_model_file(opts.model)  # a peer's closed connection
    except (ValueError, FileNotFoundError) as error:
        _error_line(rank, str(error))
        return 2
    try:
        rank, world_size, device = init_distributed()
    except RuntimeError as error:
        print(f"train_torchrun: error: {error}", file=sys.stderr)
        return 2
    try:
        _train(pipeline, opts, loaded, rank, world_size, device)
    except (ValueError, FileNotFoundError) as error:
        _error_line(rank, str(error))
        return 2
    except RuntimeError as error:
        if isinstance(error.__cause__, ValueError):  # a stage refused, under torch's stage
            _error_line(rank, str(error.__cause__))
            return 2
        if not peer_failed(error):
            raise
        # torchrun stops the other ranks when one fails, but one may see the dead peer first
        _error_line(rank, "stopped: another rank failed and closed its connection (see its "
                    "error)")
        return 2
    finally:
        try:
            dist.destroy_process_group()
        except RuntimeError as error:  # a peer that exited has nothing left to tear down
            if not peer_failed(error):
                raise
    return 0


# what gloo and NCCL say when a peer rank has exited: gloo's read sees the closed
# connection, or (under load, a write racing the peer's exit) a reset or a broken pipe
_PEER_FAILED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                "remote process exited")


def peer_failed(error: RuntimeError) -> bool:
    """Whether ``error`` is a collective's failure because another rank exited (which that
    rank's own line explains), rather than a fault of this rank's."""
    return any(text in str(error) for text in _PEER_FAILED)


def _error_line(rank: int, text: str) -> None:
    # one write: the ranks share the terminal, and print writes the newline apart
    sys.stderr.write(f"train_torchrun: error: rank {rank}: {text}\n")
    sys.stderr.flush()


def _check_batch(pipeline: DistributedPipeline, example: tuple[Any, Any],
                 batch: Mapping[str, Any]) -> None:
    """Refuse, on every rank and before any collective call, a mini-batch that is not M
    micro-batches of the example's shape, the one torch's stages are built at (see
    ``check_feed``): ``train_step`` checks it on the first stage's rank only, and the
    other ranks would then die on its closed connection instead of saying why."""
    built = pipeline.flatten_inputs(*example[0], **example[1])
    forward = inspect.signature(pipeline.flatten_inputs).replace(
        return_annotation=inspect.Signature.empty)
    try:
        forward.bind(*batch["args"], **batch["kwargs"])
    except TypeError as error:
        raise ValueError(f"the --batch inputs do not fit the model's forward{forward} "
                         f"({error}); save them as example_inputs() gives one micro-batch's"
                         ) from None
    given = pipeline.flatten_inputs(*batch["args"], **batch["kwargs"])
    names = [name for name, value in built.items() if isinstance(value, torch.Tensor)]
    check_feed(names, [tuple(built[name].shape) for name in names], [given[name] for name in names],
               pipeline.microbatches * pipeline.dp, pipeline.shared_inputs)


def _train(pipeline: DistributedPipeline, opts: argparse.Namespace,
           loaded: tuple[Any, Callable[[], nn.Module]], rank: int, world_size: int,
           device: torch.device) -> None:
    """``opts.steps`` steps of the model file ``loaded`` (module, factory) on this rank."""
    path = opts.model.partition(":")[0]
    module, build = loaded
    make_inputs = _from_file(module, build, "example_inputs")
    if make_inputs is None:
        raise ValueError(f"{path} defines no example_inputs()")
    with _raised_by(path, "example_inputs()"):
        example = make_inputs()
    args, kwargs = (((), example) if isinstance(example, Mapping)
                    else (tuple(example), {}))
    user_loss = getattr(module, "loss_fn", None)
    if not callable(user_loss):
        raise ValueError(f"{path} defines no loss_fn(output, target)")

    def loss_fn(output: Any, target: Any) -> torch.Tensor:
        with _raised_by(path, "loss_fn"):
            return user_loss(output, target)

    rss = {"start": peak_rss_bytes()}
    batch = _load_batch(opts.batch) if opts.batch else None
    checkpoint = _load_checkpoint(opts.checkpoint) if opts.checkpoint else None
    with _raised_by(path, f"{opts.model.partition(':')[2] or 'build_model'}()"), (
            parameters_on_meta() if checkpoint is not None else contextlib.nullcontext()):
        model = build()
    rss["built"] = peak_rss_bytes()
    if batch is not None:
        _check_batch(pipeline, (args, kwargs), batch)
    stages = pipeline.pipeline_stages(
        model, rank, world_size, device, *args, checkpoint=checkpoint, **kwargs
    )
    rss["loaded"] = peak_rss_bytes()
    if rank == 0 and pipeline.schedule in ZERO_BUBBLE and pipeline.uniform:  # on torch's class
        print(requirement(pipeline.schedule, pipeline.num_stages,
                          pipeline.num_ranks // pipeline.lanes, pipeline.microbatches)[0],
              flush=True)
    outputs: list[Any] = []  # with --save: the output loss_fn gets, one per micro-batch

    def saving_loss(output: Any, target: Any) -> torch.Tensor:
        outputs.append(pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), output))
        return loss_fn(output, target)

    schedule = pipeline.build_schedule(stages, saving_loss if opts.save else loss_fn)
    if batch is not None:
        args, kwargs, target = batch["args"], batch["kwargs"], batch["target"]
    else:
        m = pipeline.microbatches * pipeline.dp  # the global batch: d pipelines' M each
        # a shared input (a causal mask) is the same for any number of samples
        whole = shared_leaves(pipeline.flatten_inputs(*args, **kwargs), pipeline.shared_inputs)
        repeat = lambda t: t if not t.dim() or id(t) in whole else torch.cat([t] * m)  # noqa: E731
        args, kwargs = pytree.tree_map_only(torch.Tensor, repeat, (args, kwargs))
        # a model computing its own loss needs no example_target(): its loss gets None
        make_target = _from_file(module, build, "example_target")
        with _raised_by(path, "example_target()"):
            target = make_target() if make_target is not None else None
        target = pytree.tree_map_only(torch.Tensor, repeat, target)
    trained = list({id(p): p for stage in stages for p in stage.submod.parameters()
                    if p.requires_grad}.values())
    # a stage of parameter-free ops (a softmax mixing layer) has nothing to update
    optimizer = ({"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[opts.optimizer](
        trained, lr=opts.lr) if trained else None)
    if pipeline.scaler is not None:
        _check_every_rank_steps(bool(trained), device)
    measuring = (measure_ranks(schedule, stages, pipeline.num_stages) if opts.measure
                 else contextlib.nullcontext())
    with measuring as card:
        _steps(pipeline, opts, rank, schedule, stages, optimizer, (args, kwargs, target),
               outputs, rss)
    if card is not None and rank == 0:
        card.save(opts.measure)
        print(f"measured {card.steps} steps into {opts.measure}", flush=True)
    print(f"rank {rank}: peak RSS {peak_rss_bytes() / 2**20:.0f} MiB", flush=True)


def _check_every_rank_steps(trains: bool, device: torch.device) -> None:
    """16-mixed: the GradScaler's check for inf gradients is an all-reduce that every rank
    joins from ``scaler.step(optimizer)``, so a rank without parameters to train would
    leave the others waiting forever; every rank learns it here and says so."""
    everyone = torch.tensor(int(trains), device=device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if not everyone.item():
        raise ValueError(
            "16-mixed under torchrun steps a GradScaler on every rank, and a stage here has "
            "no parameters to train; use --precision bf16-mixed, or split so that every "
            "stage holds parameters")


def _steps(pipeline: DistributedPipeline, opts: argparse.Namespace, rank: int, schedule: Any,
           stages: list[Any], optimizer: torch.optim.Optimizer | None,
           batch: tuple[Any, Any, Any], outputs: list[Any], rss: dict[str, int]) -> None:
    """``opts.steps`` training steps; with --save, the last step's loss, gradients, bytes
    held and outputs go to rank{rank}.pt."""
    args, kwargs, target = batch
    # with --save: the bytes of parameters and gradients held inside a step
    watched = watch_step(stages) if opts.save else {}
    for step in range(opts.steps):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        outputs.clear()
        loss = pipeline.train_step(schedule, stages, *args, target=target,
                                   clip_grad_norm=opts.clip_grad_norm, **kwargs)
        # copy 0 speaks, from the first of its stage's tp GPUs
        if loss is not None and pipeline.copy_of(rank) == 0 and rank % pipeline.tp == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
        scaler = pipeline.scaler  # 16-mixed: every rank unscales, steps and updates it
        saving = step == opts.steps - 1 and opts.save
        if saving:
            if scaler is not None and optimizer is not None:
                scaler.unscale_(optimizer)  # save the gradients as the model's loss gives them
            rss["step"] = peak_rss_bytes()
            # whole: a DTensor gathered over its data-parallel shards (collective, in order),
            # a fused one in the model's order
            grads = {name: unfused(module, name, whole(p.grad.detach())).cpu().clone()
                     for stage in stages
                     for module in (cast(nn.Module, stage.submod.stage),)
                     for name, p in module.named_parameters(remove_duplicate=False)
                     if p.grad is not None}
        if optimizer is not None and scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        elif optimizer is not None:
            optimizer.step()
        if saving:
            memory = held_bytes([stage.submod for stage in stages], optimizer, watched)
            Path(opts.save).mkdir(parents=True, exist_ok=True)
            torch.save({"loss": loss, "grads": grads, "rss": rss, "outputs": outputs,
                        "memory": memory}, Path(opts.save) / f"rank{rank}.pt")
