"""Plan quality: the CP-SAT plan's bottleneck against the three baselines.

For each model and each K in ``--gpus``, runs

    fxpipe split SPEC --gpus K --device h100 --out TMP

(default memory, 1F1B, M = 4K, Adam) as a subprocess and reads ``plan.json``:
``estimate.bottleneck_s`` of the ILP plan, ``baselines[name].bottleneck_s`` and
``fits`` of uniform-layers, parameters and greedy-time, and the solver status.
Prints a markdown table with each baseline's ratio to the ILP (baseline / ILP;
>= 1 means the ILP is better) and checks that the ILP is never worse than a
baseline that fits (a violation is printed and makes the exit status 1; it is
never hidden).

Models: GPT-2 small twice (``examples/gpt.py:build_gpt2_small``, our own model, and
Hugging Face ``GPT2LMHeadModel`` with the GPT-2 small config, both with a tied
50,257-token head), Llama-3-8B (``examples/llama.py:build_llama3_8b``), Hugging Face
ViT-Base/16 at 224 x 224 (``ViTForImageClassification``) and the U-Net of
``examples/unet.py``. Every large model is built on the meta device; the Hugging
Face model files are written into a temporary folder by this script.

    python bench/plan_quality.py [--gpus 4 8] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from fxpipe.units import format_ms

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ("uniform-layers", "parameters", "greedy-time")
RTOL = 1e-9  # the ILP may tie a baseline; "worse" means worse beyond rounding

HF_GPT2_SMALL = '''\
"""Hugging Face GPT2LMHeadModel, GPT-2 small config (12 x 768, 12 heads, vocab 50257,
tied LM head), built on the meta device; one micro-batch of 2 x 1024 tokens."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    cfg = GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     tie_word_embeddings=True)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight, "head is not tied"
    return model.train()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 50257, (2, 1024), generator=g)}
'''

HF_VIT_BASE = '''\
"""Hugging Face ViTForImageClassification, ViT-Base/16 config (12 x 768, 12 heads,
patch 16, 224 x 224, 1000 classes), built on the meta device; one micro-batch of
8 images."""
import torch
from transformers import ViTConfig, ViTForImageClassification


def build_model():
    cfg = ViTConfig(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12,
                    num_attention_heads=12, intermediate_size=3072, num_labels=1000,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.device("meta"):
        model = ViTForImageClassification(cfg)
    return model.train()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(8, 3, 224, 224, generator=g)}
'''

# name -> (model spec, description); "{tmp}" is the folder with the generated files
MODELS: dict[str, tuple[str, str]] = {
    "GPT-2 small (ours)": (
        "examples/gpt.py:build_gpt2_small",
        "examples/gpt.py, 12 x 768, tied 50,257 head, micro-batch 2 x 1024",
    ),
    "GPT-2 small (HF)": (
        "{tmp}/hf_gpt2_small.py",
        "transformers GPT2LMHeadModel, GPT-2 small config, micro-batch 2 x 1024",
    ),
    "Llama-3-8B": (
        "examples/llama.py:build_llama3_8b",
        "examples/llama.py, 32 x 4096, untied 128,256 head",
    ),
    "ViT-Base/16 (HF)": (
        "{tmp}/hf_vit_base.py",
        "transformers ViTForImageClassification, 224 x 224, micro-batch 8",
    ),
    "U-Net": ("examples/unet.py", "examples/unet.py (the small CPU-test U-Net)"),
}


def fxpipe_command() -> list[str]:
    script = Path(sys.executable).parent / "fxpipe"
    if script.exists():
        return [str(script)]
    found = shutil.which("fxpipe")
    return [found] if found else [sys.executable, "-m", "fxpipe.cli"]


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def split(spec: str, gpus: int) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory(prefix="fxpipe-plan-quality-") as scratch:
        out = Path(scratch) / "out"
        command = [
            *fxpipe_command(),
            "split",
            spec,
            "--gpus",
            str(gpus),
            "--pp",
            str(gpus),
            "--device",
            "h100",
            "--out",
            str(out),
        ]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        return json.loads((out / "plan.json").read_text()), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--only", nargs="+", choices=sorted(MODELS), default=None)
    args = parser.parse_args()
    import torch

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}; load average at "
        f"start {Path('/proc/loadavg').read_text().split()[:3]}"
    )
    import fxpipe

    print(f"fxpipe from {Path(fxpipe.__file__).parent}")

    print()
    header = ["model", "K", "ILP bottleneck"]
    for name in BASELINES:
        header.append(f"{name} (× ILP)")
    header += ["best baseline / ILP", "solver", "gap", "split wall (load)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * 3 + "---:|" * (len(BASELINES) + 1) + "---|---:|---:|")
    violations: list[str] = []
    facts: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fxpipe-plan-quality-models-") as tmp:
        (Path(tmp) / "hf_gpt2_small.py").write_text(textwrap.dedent(HF_GPT2_SMALL))
        (Path(tmp) / "hf_vit_base.py").write_text(textwrap.dedent(HF_VIT_BASE))
        for label, (spec, _) in MODELS.items():
            if args.only and label not in args.only:
                continue
            spec = spec.format(tmp=tmp)
            for gpus in args.gpus:
                plan, wall = split(spec, gpus)
                ilp = plan["estimate"]["bottleneck_s"]
                cells = [
                    label,
                    str(gpus),
                    format_ms(ilp) + ("" if plan["estimate"]["fits"] else " (no fit)"),
                ]
                fitting = []
                for name in BASELINES:
                    base = plan["baselines"][name]
                    ratio = base["bottleneck_s"] / ilp
                    fits = base["fits"]
                    cells.append(
                        f"{format_ms(base['bottleneck_s'])} ({ratio:.3f}×)"
                        + ("" if fits else " **no fit**")
                    )
                    if fits:
                        fitting.append(ratio)
                        if base["bottleneck_s"] < ilp * (1 - RTOL):
                            violations.append(
                                f"{label}, K={gpus}: ILP {format_ms(ilp)} worse than {name} "
                                f"{format_ms(base['bottleneck_s'])} ({ratio:.4f}×)"
                            )
                cells.append(f"**{min(fitting):.3f}×**" if fitting else "none fits")
                solver = plan["solver"]
                cells += [
                    solver["status"],
                    f"{solver['gap']:.2%}",
                    f"{wall:.1f} s ({loadavg():.1f})",
                ]
                print("| " + " | ".join(cells) + " |", flush=True)
                tied = ", ".join(f"{k} {v}" for k, v in plan.get("tied", {}).items()) or "none"
                facts[label] = (
                    f"traced with {plan['tracer']}, {solver['graph_nodes']} graph / "
                    f"{solver['solved_nodes']} solved nodes (K={gpus}), tied: {tied}"
                )
    print()
    for label, (spec, description) in MODELS.items():
        if not args.only or label in args.only:
            print(f"- {label}: `{spec}` — {description}; {facts.get(label, '')}")
    print()
    if violations:
        print("VIOLATION: the ILP plan is worse than a baseline that fits:")
        for line in violations:
            print(f"- {line}")
        return 1
    print("Check passed: the ILP plan is never worse than a baseline that fits.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
