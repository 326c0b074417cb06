"""Does training under torchrun keep what the plan says? Peak memory per rank with and
without recompute.

A plan that recomputes a stage counts one micro-batch of its activations, not one per
micro-batch in flight. This splits an MLP whose activations outweigh its parameters
(DEPTH x Linear(WIDTH, WIDTH) + ReLU, ROWS rows per micro-batch) with ``fxpipe split
--device cpu --recompute none`` and ``--recompute all``, trains one step of each package
under ``torchrun --nproc-per-node GPUS`` (gloo, CPU) and prints, per rank, the plan's
activation bytes (saved and received for the micro-batches in flight) against the
growth of the rank's peak RSS over the step (after its stage was loaded).

    python bench/torchrun_recompute.py [--gpus 4] [--microbatches 8] [--rows 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

WIDTH, DEPTH, ROWS = {width}, {depth}, {rows}


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def example_inputs():
    return (torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1)),)


def example_target():
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(2))


def loss_fn(output, target):
    return F.mse_loss(output, target)
'''


def split(model: Path, out: Path, gpus: int, microbatches: int, recompute: str) -> dict:
    cli = "import sys; from fxpipe.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", cli, "split", str(model), "--gpus", str(gpus),
                    "--pp", str(gpus),
                    "--device", "cpu", "--microbatches", str(microbatches), "--recompute",
                    recompute, "--out", str(out)], check=True, capture_output=True, text=True,
                   cwd=ROOT)
    return json.loads((out / "plan.json").read_text())


def train(package: Path, model: Path, gpus: int, save: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                    str(gpus), str(package / "train_torchrun.py"), "--model", str(model),
                    "--save", str(save), "--lr", "0"], check=True, capture_output=True,
                   text=True, env=env, cwd=ROOT)
    return [torch.load(save / f"rank{r}.pt")["rss"] for r in range(gpus)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2048, help="rows per micro-batch")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = folder / "mlp.py"
        model.write_text(textwrap.dedent(MODEL.format(
            width=opts.width, depth=opts.depth, rows=opts.rows * opts.microbatches)))
        rows = {}
        for recompute in ("none", "all"):
            plan = split(model, folder / recompute, opts.gpus, opts.microbatches, recompute)
            rss = train(folder / recompute, model, opts.gpus, folder / f"out-{recompute}")
            rows[recompute] = (plan, rss)
    print(f"MLP {opts.depth} x Linear({opts.width}, {opts.width}) + ReLU, "
          f"{opts.rows} rows per micro-batch, M = {opts.microbatches}, 1F1B on "
          f"{opts.gpus} ranks (gloo, CPU); load average {os.getloadavg()[0]:.1f}")
    print("| rank | recompute | plan: activations | plan: received | peak RSS growth "
          "over the step |")
    print("|---:|---|---:|---:|---:|")
    for r in range(opts.gpus):
        for recompute, (plan, rss) in rows.items():
            memory = plan["stages"][r]["memory"]
            print(f"| {r} | {recompute} | {memory['activations'] / MiB:.0f} MiB | "
                  f"{memory['received'] / MiB:.0f} MiB | "
                  f"{(rss[r]['step'] - rss[r]['loaded']) / MiB:.0f} MiB |")


if __name__ == "__main__":
    main()
