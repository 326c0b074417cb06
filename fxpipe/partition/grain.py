"""Block grain: the exact groups' order cut only where a block of the model ends.

A transformer is a chain of equal layers. Inside a layer several of its own values cross
any cut (the residual beside the attention or the MLP branch); where a block ends (after
a residual add) one value does. ``block_grain`` merges the exact groups between two such
places into one: Llama-3-405B's 6,830 exact groups are 257 blocks (two a layer, and the
embedding and head).

The interval DP over the blocks (``grain_split``) is the best split whose cuts all fall
at block ends, a real split of the exact order: its bottleneck bounds the DP over the
exact groups from above, which then prices only the starts within it of each end (the
places a cut may fall, inside a block or not), and the block bound only the cells below
it. So the answer over the exact groups is the one that DP finds without it, in a
fraction of the work (405B onto 128 stages: the exact DP priced every start back to
where memory alone ruled it out). Nothing here decides a split: the exact DP and the
block bound (``bound.py``) on the exact groups do, and the gap is against the latter.

Legend: G exact groups in order, a cut at i separates groups [0, i) from [i, G).
"""

from __future__ import annotations

import numpy as np

from fxpipe.partition.baselines import interval_dp
from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.cost import NodeCosts, added_up

__all__ = ["GRAIN_SHARE", "LIGHT", "block_grain", "grain_split"]

# Blocks beyond this share of the exact groups: no repeated structure worth a first DP.
GRAIN_SHARE = 0.25
# A group below this share of the compute, parameters, saved activations and output bytes
# (a rotary table, a mask every layer reads) may send across a block's end: what it sends
# is no block's. Not a residual add: little compute and nothing saved, but it sends a
# layer's width to the next add (without the output bytes, every place in 405B's layers
# passed for a block's end, and no grain was found).
LIGHT = 1e-4


def block_grain(exact: Coarsening) -> Coarsening | None:
    """The exact groups merged between consecutive block ends (cuts at i where every
    value crossing comes from group i - 1 or a light group), as a coarsening of the
    problem; None where that leaves more than GRAIN_SHARE of the groups (no block
    structure) or fewer blocks than stages."""
    p, G = exact.problem, exact.num_coarse
    if G < 2:
        return None
    light = _light(exact)
    # crossing[i]: edges from a heavy group before i - 1 to a group at or after i
    crossing = np.zeros(G + 1, dtype=np.int64)
    for e in p.edges:
        a, b = exact.group_of[e.src], exact.group_of[e.dst]
        if a + 1 < b and not light[a]:  # crosses cuts a + 2 .. b
            crossing[a + 2] += 1
            crossing[b + 1] -= 1
    clean = np.cumsum(crossing)[:G] == 0  # clean[i]: a block may end before group i
    clean[0] = True
    block_of_group = np.cumsum(clean) - 1
    count = int(block_of_group[-1]) + 1
    if count > GRAIN_SHARE * G or count < p.num_stages:
        return None
    groups: list[list[int]] = [[] for _ in range(count)]
    for g, members in enumerate(exact.groups):
        groups[block_of_group[g]].extend(members)
    group_of = tuple(int(block_of_group[g]) for g in exact.group_of)
    edges = sorted({(int(block_of_group[a]), int(block_of_group[b]))
                    for a, b in exact.order_edges if block_of_group[a] != block_of_group[b]})
    return Coarsening(p, group_of, tuple(tuple(sorted(m)) for m in groups), tuple(edges))


def grain_split(exact: Coarsening, *, upper_s: float = float("inf")) -> tuple[int, ...] | None:
    """The interval DP's split of the blocks (``block_grain``), a stage per node: the best
    split whose cuts all fall at block ends, a split of the exact groups' order too, so
    its bottleneck bounds the interval DP's best over the exact groups from above. None
    where there is no block grain or no such split fits (or beats ``upper_s``)."""
    grain = block_grain(exact)
    if grain is None:
        return None
    split = interval_dp(grain, upper_s=upper_s)
    return grain.expand(split) if split is not None else None


def _light(exact: Coarsening) -> np.ndarray:
    """Per exact group, whether its compute, parameters, saved activations and output
    bytes are each below LIGHT of the model's."""
    costs = NodeCosts.of(exact.problem).by(exact.group_of, exact.num_coarse)
    outputs = added_up(np.asarray(exact.group_of, dtype=np.int64), exact.num_coarse,
                       np.array([node.output_bytes for node in exact.problem.nodes],
                                dtype=float))
    sums = np.column_stack((costs.compute_s, costs.params, costs.activations, outputs))
    totals = np.maximum(sums.sum(axis=0), 1e-300)
    return np.all(sums <= LIGHT * totals, axis=1)
