"""Coarsening: solve on groups of nodes that share a stage, map the answer back.

A ``Coarsening`` of a ``Problem`` is a partition of its nodes into groups (coarse
nodes), numbered in a topological order of the ordering edges between them. Two
levels are built:

``exact_groups``  merges that lose nothing: co-located nodes (``Problem.colocate``,
                  tied groups under ``TiedPolicy.COLOCATE``), cycles those create
                  with the ordering edges (their nodes are forced onto one stage),
                  and -- where empty stages are allowed -- cost-free leaves (a node
                  with no time, memory (backward transient included) or parameters,
                  not returned, whose only neighbour is one group).
``coarsen``       on top of that, fuses chains: u -> w merges when w's only ordering
                  predecessor is u or u's only successor is w (so no cycle can form),
                  while the merged time stays under ``cap`` (~ total / (4K): uncapped
                  merging lost 70% on Inception-v3) and the merged memory under a
                  quarter of the device. Zero-cost nodes join their producer or
                  consumer this way for free. This level may lose optimality; the
                  solver re-solves on ``exact_groups`` with the coarse answer as a
                  warm start, so the reported bound is always for the real problem.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fxpipe.partition.cost import NodeCosts, added_up, state_split
from fxpipe.partition.problem import Edge, Node, Problem, TiedPolicy

__all__ = ["Coarsening", "coarsen", "exact_groups"]


@dataclass(frozen=True)
class Coarsening:
    """Fine nodes grouped into coarse nodes that always share a stage."""

    problem: Problem
    group_of: tuple[int, ...]  # fine node -> coarse node
    groups: tuple[tuple[int, ...], ...]  # coarse node -> fine nodes; coarse nodes topologically
    order_edges: tuple[tuple[int, int], ...]  # ordering edges between coarse nodes, deduplicated

    @property
    def num_fine(self) -> int:
        return len(self.problem.nodes)

    @property
    def num_coarse(self) -> int:
        return len(self.groups)

    def members(self, g: int) -> tuple[str, ...]:
        """Fine-graph names of coarse node ``g``, expanding already-coarse fine nodes."""
        names: list[str] = []
        for v in self.groups[g]:
            node = self.problem.nodes[v]
            names.extend(node.members or (node.name,))
        return tuple(names)

    def expand(self, coarse_stage_of: Sequence[int]) -> tuple[int, ...]:
        """Coarse assignment -> fine assignment."""
        return tuple(coarse_stage_of[g] for g in self.group_of)

    def restrict(self, stage_of: Sequence[int]) -> tuple[int, ...]:
        """Fine assignment -> coarse one (a split group goes to its earliest stage), monotone."""
        coarse = [min(stage_of[v] for v in group) for group in self.groups]
        # Coarse nodes are in topological order: a running max keeps ordering edges valid.
        preds: list[list[int]] = [[] for _ in self.groups]
        for a, b in self.order_edges:
            preds[b].append(a)
        for g in range(len(coarse)):
            for p in preds[g]:
                coarse[g] = max(coarse[g], coarse[p])
        return tuple(coarse)

    def coarse_problem(self) -> Problem:
        """The coarse graph as a Problem, for display: costs summed, ``members`` filled.

        Communication is approximated (one value per coarse node, the largest of its
        members'); the solver does not use this, it works on ``group_of`` directly.
        """
        p = self.problem
        costs = NodeCosts.of(p).by(self.group_of, self.num_coarse)
        nodes = []
        for g, group in enumerate(self.groups):
            fine = [p.nodes[v] for v in group]
            forward_s = float(costs.forward_s[g])
            nodes.append(Node(
                name=fine[0].name if len(fine) == 1 else f"{fine[0].name}+{len(fine) - 1}",
                forward_s=forward_s,
                backward_s=float(costs.backward_s[g]),
                param_bytes=int(costs.params[g]),
                activation_bytes=int(costs.activations[g]),
                grad_bytes=int(costs.transient[g]),
                output_bytes=max(n.output_bytes for n in fine),
                comm_s=max(n.comm_s for n in fine),
                module=fine[0].module,
                members=self.members(g),
                returned=any(n.returned for n in fine),
                backward_weight_s=float(costs.backward_weight_s[g]),
                deferred_bytes=int(costs.deferred[g]),
                selective_bytes=tuple(int(b) for b in costs.selective[g]),
                # the seconds run again, SAC's host time among them, as the members add up
                selective_kept_s=tuple(forward_s - s for s in costs.selective_again_s[g].tolist()),
                writes_kept=any(n.writes_kept for n in fine),
            ))
        edges = {(self.group_of[e.src], self.group_of[e.dst]) for e in p.edges}
        ordered = set(self.order_edges)
        return Problem(
            nodes=tuple(nodes),
            edges=tuple(Edge(a, b, ordered=(a, b) in ordered) for a, b in sorted(edges) if a != b),
            num_stages=p.num_stages,
            memory_limit=p.memory_limit,
            schedule=p.schedule,
            microbatches=p.microbatches,
            state_factor=p.state_factor,
            recompute=p.recompute,
            keep_levels=p.keep_levels,
            unkept=p.unkept,
            workspace_bytes=p.workspace_bytes,
            loss_saved_bytes=p.loss_saved_bytes,
            loss_grad_bytes=p.loss_grad_bytes,
            comm=p.comm,
            allow_empty_stages=p.allow_empty_stages,
        )


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, a: int) -> int:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)
        return min(ra, rb)


def _strongly_connected(n: int, succ: list[set[int]]) -> list[int]:
    """Component id per vertex (iterative Tarjan)."""
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    stack: list[int] = []
    counter = 0
    ncomp = 0
    for root in range(n):
        if index[root] != -1:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if index[w] == -1:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, iter(sorted(succ[w]))))
                    advanced = True
                    break
                if on_stack[w]:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = ncomp
                    if w == v:
                        break
                ncomp += 1
    return comp


def _build(problem: Problem, uf: _UnionFind) -> Coarsening:
    """Groups from a union-find, numbered in a topological order (smallest fine index first)."""
    n = len(problem.nodes)
    roots = sorted({uf.find(v) for v in range(n)})
    rank = {r: i for i, r in enumerate(roots)}
    g_of = [rank[uf.find(v)] for v in range(n)]
    m = len(roots)
    succ: list[set[int]] = [set() for _ in range(m)]
    indeg = [0] * m
    for e in problem.edges:
        a, b = g_of[e.src], g_of[e.dst]
        if e.ordered and a != b and b not in succ[a]:
            succ[a].add(b)
            indeg[b] += 1
    heap = [g for g in range(m) if indeg[g] == 0]  # roots are min fine indices: graph order
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        g = heapq.heappop(heap)
        order.append(g)
        for h in succ[g]:
            indeg[h] -= 1
            if indeg[h] == 0:
                heapq.heappush(heap, h)
    assert len(order) == m, "ordering edges between groups form a cycle"
    new = {g: i for i, g in enumerate(order)}
    group_of = tuple(new[g_of[v]] for v in range(n))
    groups: list[list[int]] = [[] for _ in range(m)]
    for v in range(n):
        groups[group_of[v]].append(v)
    order_edges = sorted({(new[a], new[b]) for a in range(m) for b in succ[a]})
    return Coarsening(problem, group_of, tuple(tuple(g) for g in groups), tuple(order_edges))


def exact_groups(problem: Problem) -> Coarsening:
    """Merge only what any valid split keeps together (see the module docstring)."""
    n = len(problem.nodes)
    uf = _UnionFind(n)
    together = list(problem.colocate)
    if problem.tied_policy is TiedPolicy.COLOCATE:
        together += [t.nodes for t in problem.tied]
    for group in together:
        for v in group[1:]:
            uf.union(group[0], v)

    # Cycles through groups: every node on one forces one stage.
    while True:
        roots = sorted({uf.find(v) for v in range(n)})
        rank = {r: i for i, r in enumerate(roots)}
        succ: list[set[int]] = [set() for _ in roots]
        for e in problem.edges:
            a, b = rank[uf.find(e.src)], rank[uf.find(e.dst)]
            if e.ordered and a != b:
                succ[a].add(b)
        comp = _strongly_connected(len(roots), succ)
        if len(set(comp)) == len(roots):
            break
        first: dict[int, int] = {}
        for i, c in enumerate(comp):
            if c in first:
                uf.union(roots[first[c]], roots[i])
            else:
                first[c] = i

    if problem.allow_empty_stages:
        _merge_free_leaves(problem, uf)
    return _build(problem, uf)


def _merge_free_leaves(problem: Problem, uf: _UnionFind) -> None:
    """A group with no cost whose every edge leads to one other group goes with that group.

    Exact: on its neighbour's stage it moves nothing; anywhere else it can only add
    communication, and memory for the value sent. Not a returned node: the stage that
    produces a returned value keeps it per micro-batch in flight, fewer on a later stage.
    Only used when stages may be empty (else it might be needed to fill one).
    """
    n = len(problem.nodes)
    tied_nodes = {v for t in problem.tied for v in t.nodes}
    changed = True
    while changed:
        changed = False
        members: dict[int, list[int]] = {}
        for v in range(n):
            members.setdefault(uf.find(v), []).append(v)
        neighbours: dict[int, set[int]] = {r: set() for r in members}
        for e in problem.edges:
            a, b = uf.find(e.src), uf.find(e.dst)
            if a != b:
                neighbours[a].add(b)
                neighbours[b].add(a)
        for r, vs in members.items():
            if len(neighbours[r]) != 1:
                continue
            if any(v in tied_nodes for v in vs):
                continue
            nodes = [problem.nodes[v] for v in vs]
            if any(x.forward_s or x.backward_s or x.param_bytes or x.activation_bytes
                   or x.grad_bytes or x.returned for x in nodes):
                continue
            (other,) = neighbours[r]
            if uf.find(other) != other or uf.find(r) != r:
                continue  # touched in this sweep; look again next time
            uf.union(r, other)
            changed = True


def coarsen(problem: Problem, *, cap_s: float | None = None, base: Coarsening | None = None
            ) -> Coarsening:
    """Fuse chains of ``base`` (default ``exact_groups``) while merged time <= ``cap_s``.

    ``cap_s`` defaults to total time / (4K).
    """
    base = base or exact_groups(problem)
    K = problem.num_stages
    m = base.num_coarse
    p = problem
    grad_f, opt_f = state_split(p.state_factor)
    nodes = NodeCosts.of(p)
    time = nodes.by(base.group_of, m).compute_s.tolist()
    memory = added_up(np.asarray(base.group_of), m, nodes.params * (1 + grad_f + opt_f)
                      + nodes.activations * p.microbatches).tolist()
    cap = cap_s if cap_s is not None else sum(time) / (4 * K)
    memory_cap = p.memory_limit / 4
    tied_nodes = {v for t in p.tied for v in t.nodes}
    has_tied = [any(v in tied_nodes for v in grp) for grp in base.groups]

    uf = _UnionFind(m)
    preds: list[set[int]] = [set() for _ in range(m)]
    succs: list[set[int]] = [set() for _ in range(m)]
    for a, b in base.order_edges:
        succs[a].add(b)
        preds[b].add(a)
    alive = m
    min_groups = 1 if p.allow_empty_stages else K

    # Communication across each pair of coarse nodes: the edges that would be the most
    # expensive cuts merge first, so the cuts that survive are the cheap ones.
    link: list[dict[int, float]] = [{} for _ in range(m)]  # symmetric
    seen: set[tuple[int, int]] = set()
    for e in p.edges:
        a, b = base.group_of[e.src], base.group_of[e.dst]
        if e.data and a != b and (e.src, b) not in seen:
            seen.add((e.src, b))
            link[a][b] = link[a].get(b, 0.0) + p.nodes[e.src].comm_s
            link[b][a] = link[a][b]

    def priority(a: int, b: int) -> tuple[float, float, int, int]:
        return (-link[a].get(b, 0.0), time[a] + time[b], a, b)

    heap = [priority(a, b) for a, b in base.order_edges]
    heapq.heapify(heap)
    while heap and alive > min_groups:
        _, _, a, b = heapq.heappop(heap)
        a, b = uf.find(a), uf.find(b)
        if a == b or b not in succs[a]:
            continue
        if not (succs[a] == {b} or preds[b] == {a}):
            continue
        if time[a] + time[b] > cap or memory[a] + memory[b] > memory_cap:
            continue
        if has_tied[a] and has_tied[b]:
            continue  # keep copied tied users apart: their placement is the decision
        keep = uf.union(a, b)  # the smaller index; fold the other's adjacency into it
        gone = b if keep == a else a
        time[keep] += time[gone]
        memory[keep] += memory[gone]
        has_tied[keep] = has_tied[keep] or has_tied[gone]
        for other, c in link[gone].items():
            del link[other][gone]
            if other != keep:
                link[keep][other] = link[keep].get(other, 0.0) + c
                link[other][keep] = link[keep][other]
        link[gone] = {}
        new_preds = (preds[a] | preds[b]) - {a, b}
        new_succs = (succs[a] | succs[b]) - {a, b}
        for x in preds[gone] | succs[gone] | preds[keep] | succs[keep]:
            succs[x].discard(gone)
            preds[x].discard(gone)
            succs[x].discard(keep)
            preds[x].discard(keep)
        preds[gone], succs[gone] = set(), set()
        preds[keep], succs[keep] = new_preds, new_succs
        for x in new_preds:
            succs[x].add(keep)
            heapq.heappush(heap, priority(x, keep))
        for x in new_succs:
            preds[x].add(keep)
            heapq.heappush(heap, priority(keep, x))
        alive -= 1

    fine_uf = _UnionFind(len(p.nodes))
    for v in range(len(p.nodes)):
        fine_uf.union(v, base.groups[uf.find(base.group_of[v])][0])
    return _build(problem, fine_uf)
