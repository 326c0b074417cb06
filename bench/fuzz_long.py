"""The fuzzer's long profile: N random models split and checked, every failure kept.

    python bench/fuzz_long.py --examples 1000 [--seed 0] [--failures fuzz-failures.txt]

Runs the strategy of tests/fuzz/test_transparency.py without shrinking, records each
failure (its first error line and the drawn case) instead of stopping at the first,
and prints the count of models tried and failed, by error. Each failure is printed and
appended to ``--failures`` as it happens (no file at all when every model passes).
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

from tests.fuzz.pipeline import Case, Split, check_adapters, check_transparency
from tests.fuzz.test_transparency import cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--failures", type=Path, default=Path("fuzz-failures.txt"))
    args = parser.parse_args()

    tried = 0
    tracers: collections.Counter[str] = collections.Counter()
    features: collections.Counter[str] = collections.Counter()  # models with each generator
    # passing models: stage modules, and the schedule the plan ran
    stages: collections.Counter[int] = collections.Counter()
    schedules: collections.Counter[str] = collections.Counter()
    failures: list[tuple[str, Case, str]] = []
    start = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def run(case: Case) -> None:
        nonlocal tried
        tried += 1
        features.update(_features(case))
        with tempfile.TemporaryDirectory() as tmp:
            try:
                done = check_transparency(case, Path(tmp) / "pkg")
                check_adapters(case, done)
                tracers[done.traced.tracer] += 1
                stages[done.stages] += 1
                schedules[_schedule(done, case)] += 1
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:160]
                failures.append((f"{type(exc).__name__}: {first}", case,
                                 traceback.format_exc()))
                print(f"failure {len(failures)} (model {tried}): {failures[-1][0]}", flush=True)
                with args.failures.open("a" if len(failures) > 1 else "w",
                                        encoding="utf-8") as f:  # as they come: a long run
                    f.write(f"=== {failures[-1][0]}\n{case!r}\n{failures[-1][2]}\n")
        if tried % 50 == 0:
            print(f"{tried} models, {len(failures)} failures, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)

    run()
    wall = time.perf_counter() - start
    by_error = collections.Counter(message for message, _, _ in failures)
    print(f"models tried: {tried}; failures: {len(failures)}; "
          f"{wall:.0f} s ({wall / max(tried, 1):.2f} s per model)")
    print(f"passing models by tracer: {dict(tracers)}")
    print(f"stage modules (passing models): {dict(sorted(stages.items()))}")
    print(f"schedules (passing models): {dict(sorted(schedules.items()))}")
    print(f"models with (tried): {dict(sorted(features.items()))}")
    for message, count in by_error.most_common():
        print(f"  {count:4d}  {message}")
    return 1 if failures else 0


def _features(case: Case) -> set[str]:
    """What a drawn model and split exercise, for the table in BENCHMARKS.md."""
    spec = case.spec
    found = {f"{op.kind}:{op.how.split(':')[0]}" for op in spec.ops
             if op.kind in ("region", "mutate")}
    first = len(spec.inputs)
    if any(op.kind == "mutate" and op.srcs[0] < first for op in spec.ops):
        found.add("mutated input")
    if any(op.kind == "mutate" and op.srcs[0] >= first for op in spec.ops):
        found.add("mutated value with readers")
    if any(op.kind == "function" for op in spec.ops):
        found.add("autograd.Function")
    if spec.shared:
        found.add("shared inputs " + ("declared" if case.declare else "inferred"))
    if spec.batchnorm:
        mode = "train" if spec.train else "eval"
        recompute = ({True: "all", False: "none"}[case.recompute]
                     if isinstance(case.recompute, bool) else "per stage")
        found.add(f"batchnorm {mode}, recompute {recompute}")
    if case.replicate:
        found.add("replicate (solver)")
    if case.replicas is not None and max(case.replicas) > 1:
        found.add("replicas (runner)")
    return found


def _schedule(done: Split, case: Case) -> str:
    """The schedule the plan ran, with v when interleaved, and "replicated" where a stage
    ran on several replicas (the solver's plan, or the runner's over it)."""
    replicas = [*done.package.REPLICAS, *(case.replicas or ())[:done.stages]]
    name = done.schedule
    if name == "interleaved":
        name += f" v={done.stages // done.gpus}"
    return name + (" replicated" if max(replicas) > 1 else "")


if __name__ == "__main__":
    raise SystemExit(main())
