"""What selective recompute costs in time: torch's SAC in eager mode against no recompute
and full recompute, on a stack of transformers Llama layers.

A selective stage runs under two Python dispatch modes: torch's SAC (which asks the policy
about every aten op, runs it and caches what the policy keeps) and the runtime's own watch
for writes into a kept output (``recompute.KeptWrites``). Each op then costs the host
tens of microseconds, on its first run and on its run again, whatever the GPU's share.
This times one forward and backward of ``--layers`` layers of the scaled Llama
(``hf_shapes.LLAMA_SCALED``: width 2048, 16 heads / 8 KV heads, FFN 5632; no embedding or
LM head, so every op is a layer's) per sequence length, as a stage would run them:

- ``none``: no recompute;
- ``full``: ``torch.utils.checkpoint`` (non-reentrant), the forward run again in the backward;
- ``sac``: checkpoint under torch's SAC with the runtime's policy, keeping every matmul
  and attention output (``recompute.keeping(KEEP_ALL)``), and no watch;
- ``selective``: the runtime's own selective run (``recompute.selective_run``): SAC and
  the watch, as a stage the plan names ``"selective"`` runs.

Forward and backward are timed by CUDA events (wall clock on the CPU), medians of
``--repeats`` after two warm-ups; "host forward" is the wall time until the forward
returns, without waiting for the device: where it nears the forward's, the host is what
the device waits for. "aten ops" is what one forward dispatches (counted once).

Beside each recomputing mode, what it adds to no recompute, measured and as fxpipe plans
it: the same layers traced and costed for the device's row (h100 or h200; ``cpu`` on the
CPU), in full their forward, selectively (``"selective"``) the forward of the ops SAC does
not keep and SAC's host time on both runs (``Node.selective``, ``Device.sac_dispatch``).

    python bench/sac_overhead.py --out sac-overhead                 # on a GPU: bf16-mixed
    python bench/sac_overhead.py --small --out /tmp/sac-overhead    # tiny, on the CPU

Writes ``sac_overhead.json`` and ``sac_overhead.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import hf_shapes  # noqa: E402

from fxpipe.runtime import recompute  # noqa: E402

MODES = ("none", "full", "sac", "selective")


def layers(count: int, shape: dict[str, int], device: torch.device) -> nn.Module:
    """``count`` Llama layers of ``shape`` (and the model's final norm), seed-0 weights."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=8, hidden_size=shape["hidden"],
                         intermediate_size=shape["ffn"], num_hidden_layers=count,
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
                         max_position_embeddings=1 << 16, attention_dropout=0.0,
                         use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaModel(config).train()


def forward_of(body: nn.Module, mode: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward of ``body`` as a stage recomputing by ``mode`` runs it."""

    def run(hidden: torch.Tensor) -> torch.Tensor:
        return body(inputs_embeds=hidden).last_hidden_state

    if mode == "none":
        return run
    if mode == "full":
        return lambda hidden: checkpoint(run, hidden, use_reentrant=False)
    if mode == "sac":
        return lambda hidden: checkpoint(
            run, hidden, use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(
                recompute.keeping(recompute.KEEP_ALL)))
    return lambda hidden: recompute.selective_run(
        lambda **given: run(given["hidden"]), {"hidden": hidden}, recompute.KEEP_ALL, (),
        contextlib.nullcontext)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def aten_ops(forward: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
             autocast: Any) -> int:
    """How many aten ops one forward dispatches."""
    with torch.no_grad(), autocast, _Count() as count:
        forward(hidden)
    return count.calls


def timed(forward: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
          autocast: Any, repeats: int) -> dict[str, float]:
    """Median forward, backward and host-forward milliseconds over ``repeats`` steps."""
    cuda = hidden.device.type == "cuda"
    rows: list[tuple[float, float, float]] = []
    for step in range(repeats + 2):
        x = hidden.detach().requires_grad_()
        if cuda:
            torch.cuda.synchronize()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
        started = time.perf_counter()
        with autocast:
            out = forward(x)
        host = time.perf_counter() - started
        if cuda:
            marks[1].record()
        forward_done = time.perf_counter()
        out.float().square().mean().backward()
        if cuda:
            marks[2].record()
            torch.cuda.synchronize()
            fwd, bwd = marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])
        else:
            fwd, bwd = host * 1e3, (time.perf_counter() - forward_done) * 1e3
        if step >= 2:
            rows.append((fwd, bwd, host * 1e3))
    fwd, bwd, host = (statistics.median(column) for column in zip(*rows, strict=True))
    return {"forward_ms": fwd, "backward_ms": bwd, "host_forward_ms": host}


def planned(body: nn.Module, hidden: torch.Tensor, row: str,
            autocast: torch.dtype | None) -> dict[str, float]:
    """What fxpipe plans each recomputing mode to add to a forward and backward of
    ``body`` on ``hidden``'s shape, in milliseconds (see the module docstring)."""
    from fxpipe.compiler import analyze
    from fxpipe.cost_models import get_device
    from fxpipe.frontend import trace
    from fxpipe.lower import lower
    from fxpipe.precision import parse_precision
    from fxpipe.schedules import ScheduleKind

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = body

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return self.body(inputs_embeds=hidden).last_hidden_state

    device = get_device(row)
    traced = trace(Stage(), (hidden.to("meta"),), autocast=autocast)
    analyze(traced, device=device,
            precision=parse_precision("bf16-mixed") if autocast is not None else None)
    nodes = lower(traced.gm, num_stages=1, device=device, memory_limit=float("inf"),
                  schedule=ScheduleKind.ONE_F_ONE_B, microbatches=1).problem.nodes
    keep_all = max(len(n.selective_bytes) for n in nodes) - 1  # the last level: all kept
    # "sac" and "selective" are the same SAC, without and with the watch: one figure
    selective = 1e3 * sum(n.selective(keep_all)[1] for n in nodes)
    return {"full": 1e3 * sum(n.forward_s for n in nodes), "sac": selective,
            "selective": selective}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("sac-overhead"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seqs", type=int, nargs="*", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--small", action="store_true",
                        help="width 64, 2 layers, 64 tokens: a smoke run on the CPU")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shape = dict(hf_shapes.LLAMA_SCALED)
    if args.small:
        shape.update(hidden=64, heads=4, kv=2, ffn=128)
        args.layers, args.seqs, args.repeats = 2, [64], 3
    body = layers(args.layers, shape, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def autocast() -> Any:
        if device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=dtype)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    row_name = ("h200" if "H200" in name else "h100") if device.type == "cuda" else "cpu"
    results: dict[str, Any] = {"device": name, "row": row_name, "torch": torch.__version__,
                               "layers": args.layers, "shape": shape, "cases": []}
    lines = [f"{name}, torch {torch.__version__}, {args.layers} layers of width "
             f"{shape['hidden']} (FFN {shape['ffn']}), "
             f"{'bf16 autocast' if device.type == 'cuda' else 'float32'}, one sequence; "
             f"planned on the {row_name} row",
             "", "| tokens | mode | aten ops | forward | backward | F + B | x none "
             "| host forward | over none: measured | planned |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for seq in args.seqs:
        hidden = torch.randn(1, seq, shape["hidden"], device=device)
        plan = planned(layers(args.layers, shape, torch.device("meta")), hidden, row_name,
                       dtype if device.type == "cuda" else None)
        base = None
        for mode in MODES:
            forward = forward_of(body, mode)
            row = {"tokens": seq, "mode": mode,
                   "aten_ops": aten_ops(forward, hidden, autocast()),
                   **timed(forward, hidden, autocast(), args.repeats),
                   "planned_over_none_ms": plan.get(mode, 0.0)}
            total = row["forward_ms"] + row["backward_ms"]
            base = total if base is None else base
            results["cases"].append(row)
            lines.append(f"| {seq} | {mode} | {row['aten_ops']} | {row['forward_ms']:.2f} ms "
                         f"| {row['backward_ms']:.2f} ms | {total:.2f} ms "
                         f"| {total / base:.2f} | {row['host_forward_ms']:.2f} ms "
                         f"| {total - base:.2f} ms | {row['planned_over_none_ms']:.2f} ms |")
            print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sac_overhead.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "sac_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
