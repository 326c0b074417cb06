"""CPU seconds of each phase of one ``fxpipe split``, timed in the process.

Each function below is wrapped in a CPU timer (``time.process_time``) and the split runs
through ``fxpipe.cli.main``. Run it on one core so that no step forks a child (``Forked``
does not where one core is all the process has) and the phases add up to the CPU::

    taskset -c 0 python bench/split_phases.py split bench/gpipe_transformer.py:layers_1663 \\
        --gpus 128 --pp 128 --memory 16GiB --optimizer sgd-momentum --recompute all --device v100 \\
        --schedule 1f1b --microbatches 128 --out /tmp/x

cProfile inflates the per-node Python of the meta runs several times over, so its shares
mislead; these timers cost nothing per node. A phase nested in another is in both.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

# module, function (Class.method for a method): the phases, in the order they run
PHASES = [
    ("fxpipe.compiler", "analyze_file"),
    ("fxpipe.frontend", "_call"),  # the model file's factories
    ("fxpipe.frontend", "trace"),
    ("fxpipe.frontend", "symbolic_graph"),
    ("fxpipe.tracing.symbolic", "_Tracer.trace"),  # symbolic_trace itself
    ("fxpipe.tracing.symbolic", "_copies"),
    ("fxpipe.tracing.symbolic", "_check_runs"),
    ("fxpipe.tracing.symbolic", "_probe_dynamic"),
    ("fxpipe.frontend", "mark_copies"),
    ("fxpipe.compiler", "annotate_all"),
    ("fxpipe.passes", "annotate_memory"),
    ("fxpipe.passes", "annotate_modules"),
    ("fxpipe.compiler", "_solve"),
    ("fxpipe.compiler", "_lower"),
    ("fxpipe.compiler", "output_files"),
    ("fxpipe.compiler", "generate"),
    ("fxpipe.codegen.package", "BatchDims.of_traced"),
    ("fxpipe.codegen.package", "_stage_sources"),
    ("fxpipe.compiler", "check_builds"),
    ("fxpipe.compiler", "render_html"),
]

spent: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def _timed(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent[label] += time.process_time() - start
            calls[label] += 1
    return timed


def _wrap(module_name: str, name: str) -> None:
    owner: Any = importlib.import_module(module_name)
    *path, attribute = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    found = inspect.getattr_static(owner, attribute)  # a classmethod as such
    if isinstance(found, classmethod):
        setattr(owner, attribute, classmethod(_timed(found.__func__, name)))
    else:
        setattr(owner, attribute, _timed(found, name))


def main() -> None:
    start = time.process_time()
    import fxpipe.cli as cli

    for module_name, name in PHASES:
        _wrap(module_name, name)
    gc.set_threshold(50_000, 20, 20)  # as the console script runs (cli.run)
    cli._FREEZE_AFTER_EACH_STEP = True
    code = cli.main(sys.argv[1:])
    print(f"exit {code}; CPU {time.process_time() - start:.2f} s in all", file=sys.stderr)
    for module_name, name in PHASES:
        print(f"  {module_name} {name}: {spent[name]:.2f} s, {calls[name]} calls",
              file=sys.stderr)


if __name__ == "__main__":
    main()
