"""The fuzzer's long profile: N random models split and checked, every failure kept.

    python bench/fuzz_long.py --examples 1000 [--seed 0] [--failures fuzz-failures.txt]

Runs the strategy of tests/fuzz/test_transparency.py without shrinking, records each
failure (its first error line and the drawn case) instead of stopping at the first,
and prints the count of models tried and failed, by error.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz.pipeline import Case, check_transparency
from tests.fuzz.test_transparency import cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--failures", type=Path, default=Path("fuzz-failures.txt"))
    args = parser.parse_args()

    tried = 0
    tracers: collections.Counter[str] = collections.Counter()
    stages: collections.Counter[int] = collections.Counter()  # stages used, passing models
    failures: list[tuple[str, Case, str]] = []
    start = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def run(case: Case) -> None:
        nonlocal tried
        tried += 1
        tracers["export" if case.spec.untraceable else "symbolic_trace"] += 1
        with tempfile.TemporaryDirectory() as tmp:
            try:
                stages[check_transparency(case, Path(tmp) / "pkg")] += 1
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:160]
                failures.append((f"{type(exc).__name__}: {first}", case,
                                 traceback.format_exc()))
        if tried % 50 == 0:
            print(f"{tried} models, {len(failures)} failures, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)

    run()
    wall = time.perf_counter() - start
    if failures:  # no file at all when every model passed
        with args.failures.open("w", encoding="utf-8") as f:
            for message, case, tb in failures:
                f.write(f"=== {message}\n{case!r}\n{tb}\n")
    by_error = collections.Counter(message for message, _, _ in failures)
    print(f"models tried: {tried} ({dict(tracers)}); failures: {len(failures)}; "
          f"{wall:.0f} s ({wall / max(tried, 1):.2f} s per model)")
    print(f"stages used (passing models): {dict(sorted(stages.items()))}")
    for message, count in by_error.most_common():
        print(f"  {count:4d}  {message}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
