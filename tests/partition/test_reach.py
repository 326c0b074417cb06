"""Ancestor and descendant sums block by block between cut points (``reach.py``): the
sums of the whole reachability relation, in memory of the largest block only."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fxpipe.partition.reach import ancestor_sums, largest_block


def _brute(n: int, edges: list[tuple[int, int]], weight: np.ndarray
           ) -> tuple[list[int], list[int]]:
    """Each node's weight with its ancestors' / descendants', by a search per node."""
    succs: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        succs[a].append(b)

    def below(g: int) -> set[int]:
        seen, todo = {g}, [g]
        while todo:
            for h in succs[todo.pop()]:
                if h not in seen:
                    seen.add(h)
                    todo.append(h)
        return seen

    reached = [below(g) for g in range(n)]
    up = [int(sum(weight[a] for a in range(n) if g in reached[a])) for g in range(n)]
    down = [int(sum(weight[h] for h in reached[g])) for g in range(n)]
    return up, down


@pytest.mark.parametrize("seed", range(40))
def test_the_sums_are_those_of_every_path(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    edges = sorted({(a, b) for a, b in ((rng.randrange(n), rng.randrange(n))
                                        for _ in range(rng.randint(0, 3 * n)))
                    if a < b and (b - a < 4 or rng.random() < 0.2)})
    weight = np.array([rng.randint(0, 50) for _ in range(n)], dtype=np.int64)
    up, down = ancestor_sums(n, edges, weight)
    assert (up.tolist(), down.tolist()) == _brute(n, edges, weight)


def _layers(count: int) -> tuple[int, list[tuple[int, int]]]:
    """A chain of ``count`` residual blocks of 12 ops, each with a skip over 10."""
    n = 12 * count
    edges = [(i, i + 1) for i in range(n - 1)]
    edges += [(i, i + 11) for i in range(0, n - 11, 12)]
    return n, edges


def test_a_deep_chain_of_blocks_is_summed_a_block_at_a_time() -> None:
    """3,000 blocks (36,000 ops, GPipe's 1,663 layers' count): one n x n matrix of them
    took 11 GiB; the largest block here is 12 ops, and the sums are the chain's."""
    n, edges = _layers(3000)
    assert largest_block(n, edges) == 12
    weight = np.ones(n, dtype=np.int64)
    up, down = ancestor_sums(n, edges, weight)
    assert up.tolist() == list(range(1, n + 1))
    assert down.tolist() == list(range(n, 0, -1))


def test_an_edge_over_the_whole_graph_makes_one_block() -> None:
    n, edges = _layers(4)
    assert largest_block(n, [*edges, (0, n - 1)]) == n
