"""Numbers for people: the one place fxpipe formats bytes, seconds and counts, and reads sizes.

Every figure a person reads (the CLI's tables and messages, report.md, the diagrams, the
benchmarks) goes through here, so one value prints the same way everywhere:

    format_bytes(14173392076)  -> "13.2 GiB"    one decimal, binary units, "512 B" below 1 KiB
    format_bytes_up(2000)      -> "2.0KiB"      rounded up, no space: a value to pass to --memory
    format_seconds(0.00234)    -> "2.34 ms"     two decimals in s, ms or µs
    format_ms(0.00234)         -> "2.340 ms"    fixed unit, for columns that are compared
    format_count(1.5e9, "FLOP") -> "1.50 GFLOP" two decimals with an SI prefix
    format_indices([0, 1, 2, 5]) -> "0-2, 5"    runs of three or more as ranges

``parse_bytes`` reads sizes with the IEC/SI split that Kubernetes uses: ``KiB MiB GiB TiB``
(also ``Ki``...) are powers of 1024; ``KB MB GB TB`` (also ``K``, ``M``, ``G``, ``T``) are
powers of 1000. A bare number is bytes. Letters are case-insensitive.

Plain Python (no torch), so the solver layer may use it too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

__all__ = [
    "format_alternatives",
    "format_bytes",
    "format_bytes_up",
    "format_count",
    "format_indices",
    "format_ms",
    "format_seconds",
    "parse_bytes",
]

_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)

# Largest first: a value takes the first unit it reaches.
_BYTE_UNITS = (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_SI_PREFIXES = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920, ``"80GB"`` -> 80000000000, ``"1.5T"`` -> 1500000000000."""
    match = _PATTERN.match(text)
    if match is None:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number with an optional unit, "
            "e.g. 80GiB, 80GB, 512MiB or 1.5T"
        )
    number, prefix, binary, _ = match.groups()
    if binary and not prefix:
        raise ValueError(f"cannot read {text!r} as a size: 'i' needs a prefix, e.g. 512MiB")
    unit = (_BINARY if binary else _DECIMAL)[prefix.lower()]
    value = float(number) * unit
    if not math.isfinite(value):
        raise ValueError(f"size {text!r} is too large")
    return round(value)


def format_bytes(n: float) -> str:
    """``14173392076`` -> ``"13.2 GiB"``; one decimal, binary units; ``inf`` -> "unlimited"."""
    if n == math.inf:
        return "unlimited"
    unit, size = _byte_unit(n)
    return f"{int(n)} B" if size == 1 else f"{n / size:.1f} {unit}"


def format_bytes_up(n: float) -> str:
    """Like ``format_bytes`` but rounded up and without the space (``"2.0KiB"``): the
    smallest value that still covers ``n``, written as ``parse_bytes`` reads it, for
    "use at least ..." advice."""
    if n == math.inf:
        return "unlimited"
    unit, size = _byte_unit(n)
    return f"{math.ceil(n)}B" if size == 1 else f"{math.ceil(n / size * 10) / 10:.1f}{unit}"


def _byte_unit(n: float) -> tuple[str, int]:
    """The largest binary unit not above ``abs(n)``, or bytes."""
    return next(((unit, size) for unit, size in _BYTE_UNITS if abs(n) >= size), ("B", 1))


def format_seconds(s: float) -> str:
    """``1.5`` -> ``"1.50 s"``, ``0.00234`` -> ``"2.34 ms"``, ``7.8e-6`` -> ``"7.80 µs"``."""
    if abs(s) >= 1:
        return f"{s:.2f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.2f} µs"


def format_ms(s: float) -> str:
    """``0.00234`` -> ``"2.340 ms"``: always milliseconds, three decimals, so the figures
    of one column (stages, baselines) compare at a glance."""
    return f"{s * 1e3:.3f} ms"


def format_count(value: float, unit: str = "") -> str:
    """``1.5e9`` -> ``"1.50 G"``, with ``unit="FLOP"`` ``"1.50 GFLOP"``; ``"512"`` below 1000."""
    for prefix, scale in _SI_PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def format_indices(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6, 8, 9]`` -> ``"0-3, 6, 8, 9"``: ascending stage (or other) indices,
    each run of three or more consecutive ones as a range."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run))
                     for run in runs)


def format_alternatives(options: list[str]) -> str:
    """``["a", "b", "c"]`` -> ``"a, b or c"``: the fixes an error offers, any one of them."""
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]
