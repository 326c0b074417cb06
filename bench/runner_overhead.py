"""Overhead of ``PipelineRunner.step`` against plain gradient accumulation.

A GPT-2-small-shaped model (examples/gpt.py: 12 layers, width 768, 12 heads,
vocab 50257, tied LM head) is split by fxpipe itself into 4 stages (the
generated package's stage modules and runner; ``--hand`` uses four hand-written
stage modules instead), all on the CPU. One step of the runner (1F1B, M
micro-batches) is timed against the unsplit model doing the same M
micro-batches with ``loss / M`` and ``backward()`` each; the two are timed
alternately, so drift on the machine hits both alike.

    python bench/runner_overhead.py --repeats 7 --batch 8 --seq 64 --microbatches 4

Prints the median wall time of each, the ratio of medians and the median of
the per-round ratios (goal: <= 1.10).
"""

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    load_gpt_example,
    paired_ratio,
    split_and_load,
    time_alternately,
    token_batch,
)

from fxpipe.runtime import PipelineRunner
from fxpipe.schedules import gpipe, one_f_one_b


class Embed(nn.Module):
    """Stage 0: token + position embeddings and the first blocks."""

    INPUTS = ("idx",)

    def __init__(self, model: Any, blocks: range, name_out: str) -> None:
        super().__init__()
        self.OUTPUTS = (name_out,)
        self.tok_emb = model.tok_emb
        self.pos_emb = model.pos_emb
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return (x,)


class Middle(nn.Module):
    """A run of blocks; each stage names its output, as every value has one producer."""

    def __init__(self, model: Any, blocks: range, name_in: str, name_out: str) -> None:
        super().__init__()
        self.INPUTS = (name_in,)
        self.OUTPUTS = (name_out,)
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)

    def forward(self, **inputs: torch.Tensor) -> tuple[torch.Tensor]:
        (x,) = inputs.values()
        for block in self.blocks:
            x = block(x)
        return (x,)


class Head(nn.Module):
    """Last stage: the last blocks, the final LayerNorm and the tied LM head."""

    OUTPUTS = ("logits",)

    def __init__(self, model: Any, blocks: range, name_in: str) -> None:
        super().__init__()
        self.INPUTS = (name_in,)
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.ln_f = model.ln_f
        self.lm_head = model.lm_head

    def forward(self, **inputs: torch.Tensor) -> tuple[torch.Tensor]:
        (x,) = inputs.values()
        for block in self.blocks:
            x = block(x)
        return (self.lm_head(self.ln_f(x)),)


def split(model: Any, num_stages: int) -> list[nn.Module]:
    """Blocks spread evenly; the embeddings go first and ln_f + LM head last."""
    n = len(model.blocks)
    cuts = [round(i * n / num_stages) for i in range(num_stages + 1)]
    names = [f"x{j}" for j in range(num_stages)]
    stages: list[nn.Module] = [Embed(model, range(cuts[0], cuts[1]), names[0])]
    for j in range(1, num_stages - 1):
        stages.append(Middle(model, range(cuts[j], cuts[j + 1]), names[j - 1], names[j]))
    stages.append(Head(model, range(cuts[-2], cuts[-1]), names[-2]))
    return stages


def generated_runner(model: nn.Module, args: argparse.Namespace) -> Any:
    """Split ``model`` with fxpipe (one micro-batch traced) and load the package it writes."""
    micro = torch.zeros(args.batch // args.microbatches, args.seq, dtype=torch.long)
    generated = split_and_load(model, (micro,), stages=args.stages,
                               microbatches=args.microbatches, schedule=args.schedule)
    print(f"generated {args.stages} stages in {generated.folder}: "
          f"{[len(s.nodes) for s in generated.plan.stages]} ops per stage")
    return generated.package.PipelineRunner(generated.package.build_stages(model))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--small", action="store_true", help="the 4x128 test GPT (smoke run)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--hand", action="store_true",
                        help="hand-written stage modules instead of fxpipe's generated ones")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    gpt = load_gpt_example()
    cfg = gpt.SMALL if args.small else gpt.GPT2_SMALL
    model = gpt._build(cfg)  # real weights on the CPU
    m = args.microbatches
    make_schedule = one_f_one_b if args.schedule == "1f1b" else gpipe
    if args.hand:
        runner = PipelineRunner(
            split(model, args.stages),
            schedule=make_schedule(args.stages, m),
            microbatches=m,
            flatten_inputs=lambda idx: {"idx": idx},
            build_output=lambda values: values["logits"],
        )
    else:
        runner = generated_runner(model, args)
    idx, target = token_batch(cfg.vocab_size, args.batch, args.seq)

    def accumulate() -> float:
        total = torch.zeros(())
        for x_m, y_m in zip(idx.tensor_split(m), target.tensor_split(m), strict=True):
            loss = loss_fn(model(x_m), y_m) / m
            loss.backward()
            total += loss.detach()
        return total.item()

    def pipelined() -> float:
        return runner.step((idx,), target, loss_fn).item()

    timings = time_alternately([("accumulate", accumulate), ("runner", pipelined)],
                               args.repeats, before=lambda: model.zero_grad(set_to_none=True),
                               log=True)
    base = statistics.median(timings["accumulate"])
    ours = statistics.median(timings["runner"])
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\nGPT {cfg.n_layer}x{cfg.n_embd} ({params / 1e6:.0f}M params), batch {args.batch} x "
        f"seq {args.seq}, {args.stages} stages, M={m}, {args.schedule}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    paired = paired_ratio(timings, "runner", "accumulate")
    print(
        f"median accumulate {base:.3f} s, runner.step {ours:.3f} s, ratio of medians "
        f"{ours / base:.3f}, median of per-round ratios {paired:.3f}"
    )


if __name__ == "__main__":
    main()
