"""The plan's activation bytes against what autograd really keeps, across the zoo.

    python bench/saved_bytes.py [--only gpt2,t5] [--seq 64]

For every transformers family of ``bench/zoo.py`` (small random configs, float32, nothing
downloaded): the model file is written and loaded as ``fxpipe split`` does, traced, and
planned onto one stage with ``--device cpu`` and one micro-batch, in ``32-true`` and in
``bf16-mixed``. The plan's ``activations`` for that stage is set against the bytes of the
unique storages that ``saved_tensors_hooks`` sees in one real forward of the traced graph
(the graph the generated stages run) on this CPU, parameters and the stage's own inputs
excluded (the plan counts those as received). The zoo's sequences are lengthened to
``--seq`` so that activations, not per-call constants, make up the bytes. A ratio of 1.00
is a plan that keeps what the device keeps; above, the plan is pessimistic (splits that
would fit are refused); below, it is optimistic (a plan that says "fits" runs out of
memory).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.zoo import TRANSFORMERS, Family
from fxpipe.compiler import analyze_file
from fxpipe.precision import Precision
from tests.passes.test_saved_bytes import CPU, planned_activations, real_saved_bytes


def lengthened(family: Family, seq: int) -> Family:
    kind, fields = family.inputs
    if "seq" in fields:
        fields = {**fields, "seq": seq}
    # room for every position (RoBERTa's start after the padding index)
    build = re.sub(r"\b(max_position_embeddings|n_positions|max_target_positions)=\d+",
                   lambda m: f"{m.group(1)}={2 * seq}", family.build)
    return replace(family, dtype="float32", inputs=(kind, fields), build=build)


def measure(family: Family, precision: Precision, folder: Path) -> tuple[int, int]:
    model_file = folder / f"{family.slug}.py"
    model_file.write_text(family.source())
    _, traced = analyze_file(str(model_file), device=CPU, precision=precision)
    return planned_activations(traced, precision), real_saved_bytes(
        traced, precision.dtype if precision.mixed else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated slugs")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--debug", action="store_true", help="print each error's traceback")
    args = parser.parse_args()
    wanted = {s for s in args.only.split(",") if s}
    families = [lengthened(f, args.seq) for f in TRANSFORMERS
                if not wanted or f.slug in wanted]
    precisions = (Precision.TRUE_32, Precision.BF16_MIXED)
    print("| model | " + " | ".join(f"{p.value} plan / real (KiB)" for p in precisions)
          + " | " + " | ".join(f"{p.value} ratio" for p in precisions) + " |")
    print("|---|" + "---:|" * (2 * len(precisions)))
    ratios: dict[Precision, list[float]] = {p: [] for p in precisions}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            cells: list[str] = []
            shown: list[str] = []
            for precision in precisions:
                try:
                    planned, real = measure(family, precision, Path(tmp))
                except Exception as exc:  # one row says why; the table goes on
                    first = (str(exc).strip().splitlines() or [""])[0][:100]
                    cells.append(f"error: {type(exc).__name__}: {first}")
                    shown.append("")
                    if args.debug:
                        traceback.print_exc()
                    continue
                ratio = planned / real if real else float("nan")
                ratios[precision].append(ratio)
                cells.append(f"{planned / 1024:,.0f} / {real / 1024:,.0f}")
                shown.append(f"{ratio:.2f}")
            print(f"| {family.name} | " + " | ".join(cells) + " | " + " | ".join(shown) + " |",
                  flush=True)
    print()
    for precision, found in ratios.items():
        if found:
            within = sum(1 for r in found if abs(r - 1) <= 0.10)
            print(f"{precision.value}: {len(found)} models, median ratio "
                  f"{statistics.median(found):.3f}, range {min(found):.2f}-{max(found):.2f}, "
                  f"{within} within 10%")
    print(f"{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
