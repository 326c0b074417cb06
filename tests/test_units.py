"""fxpipe.units: every figure for people, at the unit boundaries, and sizes read back."""

from __future__ import annotations

import math

import pytest

from fxpipe.units import (
    format_bytes,
    format_bytes_up,
    format_count,
    format_indices,
    format_ms,
    format_seconds,
    parse_bytes,
)

GiB = 2**30


@pytest.mark.parametrize(("text", "expected"), [
    ("80GiB", 80 * GiB),
    ("80GB", 80 * 10**9),
    ("512MiB", 512 * 2**20),
    ("1.5T", 1.5 * 10**12),
    ("1.5Ti", 1.5 * 2**40),
    ("4096", 4096),
    ("2 gib", 2 * GiB),
    (".5K", 500),
])
def test_parse_bytes(text: str, expected: float) -> None:
    assert parse_bytes(text) == int(expected)


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "80 GiBs", "1.2.3G", "80iB", "nan", "1e9"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"),
    (1023, "1023 B"),
    (1024, "1.0 KiB"),
    (2**20 - 1, "1024.0 KiB"),  # rounds to the unit it has not reached
    (2**20, "1.0 MiB"),
    (512 * 2**20, "512.0 MiB"),
    (GiB - 1, "1024.0 MiB"),
    (GiB, "1.0 GiB"),
    (13.2 * GiB, "13.2 GiB"),
    (2**40, "1.0 TiB"),
    (2**50, "1.0 PiB"),
    (math.inf, "unlimited"),
])
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(("n", "text"), [
    (100, "100B"),
    (1023.5, "1024B"),
    (1024, "1.0KiB"),
    (1025, "1.1KiB"),  # up, never down: the advice must cover what is needed
    (round(1.9 * 1024) + 1, "2.0KiB"),
    (13.2 * GiB, "13.2GiB"),
])
def test_format_bytes_up_covers_and_reads_back(n: float, text: str) -> None:
    assert format_bytes_up(n) == text
    assert parse_bytes(text) >= n


@pytest.mark.parametrize(("s", "text"), [
    (2.0, "2.00 s"),
    (1.0, "1.00 s"),
    (0.999, "999.00 ms"),
    (0.00234, "2.34 ms"),
    (1e-3, "1.00 ms"),
    (0.000999, "999.00 µs"),
    (7.8e-6, "7.80 µs"),
    (0.0, "0.00 µs"),
])
def test_format_seconds(s: float, text: str) -> None:
    assert format_seconds(s) == text


def test_format_ms_keeps_one_unit() -> None:
    assert format_ms(2.5) == "2500.000 ms"
    assert format_ms(0.00234) == "2.340 ms"
    assert format_ms(0.0) == "0.000 ms"


@pytest.mark.parametrize(("value", "unit", "text"), [
    (999, "", "999"),
    (1000, "", "1.00 k"),
    (999_999, "", "1000.00 k"),
    (1e6, "", "1.00 M"),
    (1.5e9, "", "1.50 G"),
    (1.5e9, "FLOP", "1.50 GFLOP"),
    (1e12, "FLOP", "1.00 TFLOP"),
    (3e15, "", "3.00 P"),
    (12, "FLOP", "12 FLOP"),
])
def test_format_count(value: float, unit: str, text: str) -> None:
    assert format_count(value, unit) == text


@pytest.mark.parametrize(("indices", "text"), [
    ([3], "3"),
    ([0, 1], "0, 1"),
    ([0, 1, 2], "0-2"),
    ([9, 0, 1, 2, 3, 6, 8], "0-3, 6, 8, 9"),
    (range(30), "0-29"),
    ([], ""),
])
def test_format_indices(indices: list[int], text: str) -> None:
    assert format_indices(indices) == text
