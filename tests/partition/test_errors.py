"""User-facing errors and the byte helpers the CLI uses."""

from __future__ import annotations

import pytest

from fxpipe.partition import (
    Edge,
    InfeasibleMemoryError,
    Node,
    Problem,
    TooManyStagesError,
    format_bytes,
    parse_bytes,
    partition,
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


def test_format_bytes() -> None:
    assert format_bytes(13.2 * GiB) == "13.2 GiB"
    assert format_bytes(512 * 2**20) == "512.0 MiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(float("inf")) == "unlimited"


def test_more_stages_than_nodes() -> None:
    nodes = tuple(Node(f"n{i}", 1, 1) for i in range(3))
    p = Problem(nodes, (Edge(0, 1), Edge(1, 2)), num_stages=8)
    with pytest.raises(TooManyStagesError) as info:
        partition(p)
    assert str(info.value) == "Cannot cut 3 nodes into 8 stages; use --gpus 3 or fewer."
    assert isinstance(info.value, ValueError)


def test_more_stages_than_colocated_groups() -> None:
    nodes = tuple(Node(f"n{i}", 1, 1) for i in range(4))
    p = Problem(nodes, (Edge(0, 1), Edge(1, 2), Edge(2, 3)), num_stages=3, colocate=((0, 3),))
    with pytest.raises(TooManyStagesError, match=r"only 1 groups .* use --gpus 1 or fewer"):
        partition(p)


def test_no_split_fits_memory_says_what_would() -> None:
    # 8 layers of 6.6 GiB onto 4 GPUs: two per GPU needs 13.2 GiB.
    size = round(6.6 * GiB)
    nodes = tuple(Node(f"n{i}", 1, 1, param_bytes=size) for i in range(8))
    p = Problem(nodes, tuple(Edge(i, i + 1) for i in range(7)), num_stages=4,
                memory_limit=10 * GiB, state_factor=1.0)
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(p, time_limit_s=10)
    assert str(info.value) == (
        "No split of the model onto 4 GPUs fits in 10.0 GiB per GPU; the best split needs "
        "13.2 GiB. Use --memory 13.2GiB or more GPUs.")
    assert info.value.needed == 2 * size
