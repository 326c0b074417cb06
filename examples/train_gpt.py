"""An ordinary training loop for the example GPT that switches to fxpipe's stages.

    python examples/train_gpt.py --steps 5                    # the model as it is
    fxpipe split examples/gpt.py --gpus 4 --out gpt-pipe      # cut it into 4 stages
    python examples/train_gpt.py --steps 5 --pipeline gpt-pipe

Both runs print the same losses: the pipeline runs M micro-batches per step and
leaves in the model's own parameters the gradients the whole mini-batch gives.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fxpipe.codegen import load_package

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # the bundled example model, beside this file


def mini_batch(step: int, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets for ``microbatches`` micro-batches of the example size."""
    cfg = gpt.SMALL
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, cfg.vocab_size, (microbatches * cfg.batch_size, cfg.seq_len + 1),
                        generator=g)
    return ids[:, :-1], ids[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--microbatches", type=int, default=None,
        help="micro-batches per mini-batch (default: the pipeline plan's; without "
        "--pipeline 16, what fxpipe split --gpus 4 plans), so both runs see the same data")
    parser.add_argument("--pipeline", default=None, help="folder written by fxpipe split")
    args = parser.parse_args()

    model = gpt.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    microbatches = args.microbatches or 16

    if args.pipeline is None:
        def train_step(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = gpt.loss_fn(model(inputs), target)
            loss.backward()
            return loss
    else:
        # The few lines that switch to the pipeline: stages bind the model's own parameters,
        # so the optimizer, checkpoints and the rest of the loop stay as they are.
        try:
            pipe = load_package(args.pipeline)  # the folder fxpipe split --out wrote
        except ValueError as error:
            raise SystemExit(f"train_gpt: error: {error}") from None
        runner = pipe.PipelineRunner(pipe.build_stages(model))
        planned = pipe.PLAN["microbatches"]
        if args.microbatches not in (None, planned):
            raise SystemExit(f"train_gpt: error: --microbatches {args.microbatches} differs "
                             f"from the {planned} the plan was made for; drop the flag")
        microbatches = planned

        def train_step(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return runner.step((inputs,), target, gpt.loss_fn)

    for step in range(args.steps):
        inputs, target = mini_batch(step, microbatches)
        optimizer.zero_grad()
        loss = train_step(inputs, target)
        optimizer.step()
        print(f"step {step}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
