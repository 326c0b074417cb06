"""Bytes for people: ``format_bytes`` for messages and reports, ``parse_bytes`` for the CLI.

Suffixes follow the IEC/SI split that Kubernetes uses: ``KiB MiB GiB TiB`` (also ``Ki``...)
are powers of 1024; ``KB MB GB TB`` (also ``K``, ``M``, ``G``, ``T``) are powers of 1000.
A bare number is bytes. Letters are case-insensitive.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "parse_bytes"]

_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920, ``"80GB"`` -> 80000000000, ``"1.5T"`` -> 1500000000000."""
    match = _PATTERN.match(text)
    if match is None:
        raise ValueError(
            f"Cannot read {text!r} as a size; write a number with an optional unit, "
            "e.g. 80GiB, 80GB, 512MiB or 1.5T."
        )
    number, prefix, binary, _ = match.groups()
    if binary and not prefix:
        raise ValueError(f"Cannot read {text!r} as a size: 'i' needs a prefix, e.g. 512MiB.")
    unit = (_BINARY if binary else _DECIMAL)[prefix.lower()]
    value = float(number) * unit
    if not math.isfinite(value):
        raise ValueError(f"Size {text!r} is too large.")
    return round(value)


def format_bytes(n: float) -> str:
    """``14173392076`` -> ``"13.2 GiB"``; one decimal, binary units."""
    if n == float("inf"):
        return "unlimited"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def format_bytes_up(n: float) -> str:
    """Like ``format_bytes`` but rounded up, for "you need at least ..." messages."""
    if n == float("inf"):
        return "unlimited"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{math.ceil(n / size * 10) / 10:.1f}{unit}"
    return f"{math.ceil(n)}B"
