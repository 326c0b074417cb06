"""The gradient error of a pp 2 x tp 2 step against the unsplit model (float64, gloo,
relative to the largest gradient), for the models tests/distributed/
test_tensor_parallel_torchrun.py checks to 1e-12: the figures in
docs/benchmarks/tensor-parallel.md.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/tensor_parallel_errors.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tests.distributed import test_tensor_parallel_torchrun as tp

MODELS = (("examples/gpt.py (2nd step)", tp.GPT64, 2), ("HF Llama, GQA", tp.LLAMA64, 1),
          ("HF GPT-2", tp.HF_GPT2_64, 1))


def main() -> None:
    for label, model, steps in MODELS:
        start = time.perf_counter()
        _, batch, saves = tp._run(Path(tempfile.mkdtemp()), model, "--pp", "2", "--tp", "2",
                                  steps=steps)
        wall = time.perf_counter() - start
        _, expected, _ = tp._unsplit(model, batch, steps)
        largest = max(float(g.abs().max()) for g in expected.values())
        error = max(float((save["grads"][name] - expected[name]).abs().max())
                    for save in saves for name in save["grads"])
        print(f"{label}: {error / largest:.2e} of the largest gradient ({wall:.0f} s wall)")


if __name__ == "__main__":
    main()
