"""What selective activation checkpointing (SAC) really keeps, against its estimate.

``bench/recompute_bound.py`` prices SAC chosen per stage (the outputs of the matmuls and
attention kept, the rest recomputed in the backward) from the traced graph: a layer keeps
the output bytes of its ``linear``, ``matmul`` and ``scaled_dot_product_attention`` nodes.
Before SAC is built into the planner, this checks that estimate against torch's own SAC
on this CPU: transformers' Llama (2 layers, float32, one micro-batch of 1 x SEQ tokens),
traced as ``fxpipe split`` traces it, is run under ``torch.utils.checkpoint`` with a policy
that saves the outputs of ``aten.mm``, ``addmm``, ``bmm`` and the fused attention kernels,
and the bytes of the unique storages in SAC's cache are set against the estimate and
against what a forward without checkpointing saves (``saved_tensors_hooks``, as
tests/passes/test_saved_bytes.py measures it). Prints a markdown table.

    python bench/sac_saved.py [--shapes 256:512 512:1024 1024:2048]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.recompute_bound import SAVED_BY_SAC
from tests.passes.test_saved_bytes import llama, real_saved_bytes

aten = torch.ops.aten
# The aten ops whose outputs the policy keeps: the matmuls and the fused attention kernels.
KEPT = {aten.mm.default, aten.addmm.default, aten.bmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default}


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def sac_bytes(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> int:
    """Bytes of the unique storages SAC's cache holds after one forward of ``gm``, the
    parameters, buffers and inputs left out."""
    skip = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers(), *inputs)
            if isinstance(t, torch.Tensor)}
    contexts = []

    def context() -> Any:
        contexts.append(create_selective_checkpoint_contexts(_policy))
        return contexts[-1]

    checkpoint(lambda *xs: torch.fx.Interpreter(gm).run(*xs), *inputs, use_reentrant=False,
               context_fn=context)
    storages: dict[int, int] = {}
    for entries in contexts[0][0].storage.values():  # op -> {call: its cached outputs}
        for entry in entries.values():
            for wrapper in entry if isinstance(entry, tuple | list) else [entry]:
                value = getattr(wrapper, "val", None)  # recomputed ops hold a sentinel
                if isinstance(value, torch.Tensor):
                    storage = value.untyped_storage()
                    if storage.data_ptr() not in skip:
                        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def estimated_bytes(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> int:
    """The estimate: the output bytes of the graph's SAC-kept nodes, by name, read off a
    run of the graph (its recorded shapes are symbolic)."""
    total = 0

    class Outputs(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            nonlocal total
            result = super().run_node(node)
            if node.op == "call_function" and node.name.rstrip("_0123456789") in SAVED_BY_SAC:
                total += result.numel() * result.element_size()
            return result

    with torch.no_grad():
        Outputs(gm).run(*inputs)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=["256:512", "512:1024", "1024:2048"],
                        help="WIDTH:TOKENS")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, load average before {os.getloadavg()}\n")
    mib = 2 ** 20
    print("| width | tokens | full forward saves | SAC keeps | estimate | estimate / SAC "
          "| SAC / full |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        width, seq = (int(v) for v in shape.split(":"))
        traced = llama(width, seq)
        full = real_saved_bytes(traced)
        kept = sac_bytes(traced.gm, traced.flat_inputs)
        estimate = estimated_bytes(traced.gm, traced.flat_inputs)
        print(f"| {width} | {seq} | {full / mib:.2f} MiB | {kept / mib:.2f} MiB | "
              f"{estimate / mib:.2f} MiB | {estimate / kept:.4f} | {kept / full:.2f} |",
              flush=True)
    print(f"\nload average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
