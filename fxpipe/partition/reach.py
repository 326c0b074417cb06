"""The weight of each node with its ancestors, and with its descendants, in a DAG numbered
topologically: exactly, block by block between its cut points.

A cut point ``c`` is a node no edge jumps over (no edge ``a -> b`` with ``a < c < b``):
every path from a node before ``c`` to one after it passes through ``c``. So a node ``g``
after ``c`` has ancestors before ``c`` only if ``c`` reaches it, and then they are ``c``'s.
Each block between two cut points needs a reachability matrix of its own size only, not
the graph's: a transformer's blocks are a dozen ops whatever its depth, and 36,589 ops of
1,663 layers take megabytes where one n x n matrix took 12 GiB. A graph with an edge over
all of it (a skip from its first op to its last) is one block: that n x n matrix again
(``largest_block`` says how large before anything is built).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

__all__ = ["ancestor_sums", "largest_block"]


def ancestor_sums(n: int, edges: Sequence[tuple[int, int]], weight: np.ndarray,
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Per node (topologically numbered): total weight of it and its ancestors / descendants."""
    up = _up(n, edges, weight)
    mirrored = [(n - 1 - b, n - 1 - a) for a, b in edges]
    down = _up(n, mirrored, weight[::-1].copy())[::-1].copy()
    return up, down


def largest_block(n: int, edges: Sequence[tuple[int, int]]) -> int:
    """The most nodes between two successive cut points, both counted."""
    cuts = _cut_points(n, edges)
    return max((int(b - a) + 1 for a, b in pairwise(cuts)), default=n)


def _cut_points(n: int, edges: Sequence[tuple[int, int]]) -> np.ndarray:
    """The nodes no edge jumps over, in order (the first and last always among them)."""
    jumps = np.zeros(n + 1, dtype=np.int64)  # +1 where an edge starts over a node, -1 after
    for a, b in edges:
        assert a < b, "edges must follow the topological numbering"
        jumps[a + 1] += 1
        jumps[b] -= 1
    return np.flatnonzero(np.cumsum(jumps[:n]) == 0)


def _up(n: int, edges: Sequence[tuple[int, int]], weight: np.ndarray) -> np.ndarray:
    """Per node, its weight with its ancestors'."""
    preds: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        preds[b].append(a)
    up = np.zeros(n, dtype=np.int64)
    if n == 0:
        return up
    cuts = _cut_points(n, edges).tolist()
    up[0] = weight[0]  # node 0 is a cut point with no ancestors
    for first, last in pairwise(cuts):
        size = int(last - first) + 1
        if size == 2:  # the common case, a step along a chain: no matrix
            joined = first in preds[last]
            up[last] = weight[last] + (up[first] if joined else 0)
            continue
        # reach[i, j]: node first + j reaches node first + i (or is it)
        reach = np.eye(size, dtype=bool)
        for i in range(1, size):
            for p in preds[first + i]:
                assert p >= first, "an edge jumps over a cut point"
                reach[i] |= reach[p - first]
        local = reach.astype(np.int64) @ weight[first:last + 1]
        # ancestors before ``first`` are first's, where first reaches the node
        up[first + 1:last + 1] = (local[1:] + np.where(reach[1:, 0], up[first] - weight[first], 0))
    return up
