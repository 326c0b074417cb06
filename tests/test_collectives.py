"""The ring all-reduce, written once (fxpipe/collectives.py), and its three readers: the
cost models' tied-parameter sum, the solver's replicated stages and the layout search's
gradient sync price it alike, to the bit."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from fxpipe.collectives import ring_allreduce_s
from fxpipe.cost_models.comm import allreduce_time
from fxpipe.partition import Node, Problem
from fxpipe.partition.layout import Link, sync_s
from fxpipe.partition.problem import allreduce_s, allreduce_terms

PACKAGE = Path(__file__).resolve().parents[1] / "fxpipe"


def test_a_ring_of_four_moves_one_and_a_half_times_the_bytes() -> None:
    # 2 (r - 1) / r = 1.5 of 8 GB at 100 GB/s, and 6 messages of 1 ms
    assert ring_allreduce_s(8e9, 4, 100e9, 1e-3) == pytest.approx(0.12 + 0.006)
    assert ring_allreduce_s(8e9, 1, 100e9, 1e-3) == 0.0  # one rank: nothing to sum
    assert ring_allreduce_s(0, 2, 100e9, 1e-3) == pytest.approx(2e-3)  # the messages still go


@pytest.mark.parametrize(("nbytes", "ranks"), list(itertools.product(
    [1, 3, 4096, 7 * 10**9 + 13], [1, 2, 3, 5, 8, 24])))
def test_every_reader_prices_the_ring_alike(nbytes: int, ranks: int) -> None:
    bandwidth, latency = 123.4e9, 3.7e-6
    ring = ring_allreduce_s(nbytes, ranks, bandwidth, latency)
    assert allreduce_time(nbytes, ranks, bandwidth, latency) == ring
    assert sync_s(nbytes, ranks, Link(bandwidth, latency)) == ring
    problem = Problem((Node("a", 1.0, 1.0),), (), num_stages=1,
                      allreduce_bandwidth=bandwidth, allreduce_latency_s=latency)
    per_byte, fixed = allreduce_terms(problem, ranks)
    assert (per_byte, fixed) == (ring_allreduce_s(1, ranks, bandwidth, 0.0),
                                 ring_allreduce_s(0, ranks, bandwidth, latency))
    assert allreduce_s(problem, nbytes, ranks) == pytest.approx(ring, rel=1e-15)


def test_nothing_to_sum_is_the_callers_rule() -> None:
    """No collective runs for no bytes in the cost models and the layout search; the
    solver's replicas synchronise every step, parameters or not."""
    link = Link(100e9, 1e-3)
    assert allreduce_time(0, 4, link.bandwidth, link.latency_s) == 0.0
    assert sync_s(0, 4, link) == 0.0
    problem = Problem((Node("a", 1.0, 1.0),), (), num_stages=1,
                      allreduce_bandwidth=link.bandwidth, allreduce_latency_s=1e-3)
    assert allreduce_s(problem, 0, 4) == pytest.approx(6e-3)


def test_the_ring_is_written_once() -> None:
    """``2 * (ranks - 1)`` steps appear in fxpipe/collectives.py alone."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
                    and isinstance(node.left, ast.Constant) and node.left.value == 2
                    and isinstance(node.right, ast.BinOp) and isinstance(node.right.op, ast.Sub)
                    and isinstance(node.right.right, ast.Constant)
                    and node.right.right.value == 1):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == [f"collectives.py:{_line('collectives.py', 'steps = 2 *')}"]


def _line(name: str, text: str) -> int:
    lines = (PACKAGE / name).read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(lines, start=1) if text in line)
