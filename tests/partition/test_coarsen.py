"""Coarsening: valid DAG, members kept, assignments mapped back, optimum preserved."""

from __future__ import annotations

import random

import pytest

from fxpipe.partition import (
    Comm,
    Edge,
    Node,
    Problem,
    StageModel,
    coarsen,
    evaluate,
    exact_groups,
    partition,
    violations,
)


def random_problem(seed: int, n: int = 24, K: int = 3) -> Problem:
    rng = random.Random(seed)
    nodes = tuple(
        Node(f"n{i}", rng.choice([0.0, 0.0, rng.randint(1, 9) * 1e-3]), rng.randint(0, 9) * 1e-3,
             param_bytes=rng.randint(0, 4) * 10, output_bytes=8,
             comm_s=rng.randint(0, 3) * 1e-3, module=f"block{i // 4}")
        for i in range(n)
    )
    edges = [Edge(i, i + 1) for i in range(n - 1)]
    edges += [Edge(u, w) for u in range(n) for w in range(u + 2, min(n, u + 5))
              if rng.random() < 0.2]
    edges += [Edge(w, u, ordered=False) for u, w in [(3, 9), (5, 20)] if w < n]
    return Problem(nodes, tuple(edges), num_stages=K, comm=rng.choice(list(Comm)),
                   colocate=((1, 2),))


@pytest.mark.parametrize("seed", range(8))
def test_coarse_graph_is_a_dag_in_topological_order(seed: int) -> None:
    p = random_problem(seed)
    c = coarsen(p)
    assert c.num_fine == len(p.nodes)
    assert c.num_coarse < c.num_fine
    assert all(a < b for a, b in c.order_edges)
    assert sorted(v for g in c.groups for v in g) == list(range(len(p.nodes)))
    assert c.group_of[1] == c.group_of[2]  # co-located stay together
    cap = sum(n.forward_s + n.backward_s for n in p.nodes) / (4 * p.num_stages)
    exact = exact_groups(p)
    for group in c.groups:
        time = sum(p.nodes[v].forward_s + p.nodes[v].backward_s for v in group)
        parts = {exact.group_of[v] for v in group}
        assert time <= cap + 1e-12 or len(parts) == 1
    names = [name for g in range(c.num_coarse) for name in c.members(g)]
    assert sorted(names) == sorted(n.name for n in p.nodes)
    coarse_problem = c.coarse_problem()
    assert len(coarse_problem.nodes) == c.num_coarse


@pytest.mark.parametrize("seed", range(8))
def test_expand_and_restrict(seed: int) -> None:
    p = random_problem(seed)
    c = coarsen(p)
    coarse_split = [min(p.num_stages - 1, g * p.num_stages // c.num_coarse)
                    for g in range(c.num_coarse)]
    fine = c.expand(coarse_split)
    assert not violations(p, fine)
    assert c.restrict(fine) == tuple(coarse_split)


@pytest.mark.parametrize("seed", range(10))
def test_coarsening_preserves_the_optimum(seed: int) -> None:
    p = random_problem(seed, n=16)
    with_coarsening = partition(p, time_limit_s=20, coarsen=True, workers=1)
    without = partition(p, time_limit_s=20, coarsen=False, workers=1)
    fine = StageModel(exact_groups(p)).solve(time_limit_s=20, workers=1)
    assert with_coarsening.report.status == without.report.status == "OPTIMAL"
    assert with_coarsening.report.objective == pytest.approx(without.report.objective, abs=1e-12)
    assert evaluate(p, fine.stage_of).bottleneck_s == pytest.approx(  # type: ignore[arg-type]
        without.report.objective, abs=1e-12)
    assert with_coarsening.coarse_nodes < len(p.nodes)
    assert with_coarsening.report.solved_nodes == exact_groups(p).num_coarse


def test_uncapped_coarse_answer_is_repaired_by_the_exact_solve() -> None:
    # Heavy cut communication everywhere except one place the coarse graph hides.
    p = random_problem(3, n=16)
    coarse = coarsen(p, cap_s=float("inf"))
    assert coarse.num_coarse <= 3
    answer = StageModel(coarse).solve(time_limit_s=10, workers=1)
    exact = partition(p, time_limit_s=20, workers=1)
    assert exact.report.objective <= evaluate(p, answer.stage_of).bottleneck_s  # type: ignore[arg-type]


def test_export_model(tmp_path: object) -> None:
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "model.pbtxt"
    StageModel(exact_groups(random_problem(0))).export_model(str(path))
    assert "variables" in path.read_text()


@pytest.mark.parametrize("grad_bytes", [0, 100])
def test_free_leaf_joins_its_neighbour_only_without_a_backward_transient(
        grad_bytes: int) -> None:
    # a -> b, and a cost-free leaf c reading a. Where stages may stay empty, c goes with
    # a for free -- unless its backward holds gradients: then where it sits decides which
    # stage's largest transient it raises, so the solver must place it.
    nodes = (Node("a", 1e-3, 1e-3, grad_bytes=30), Node("b", 1e-3, 1e-3),
             Node("c", 0.0, 0.0, grad_bytes=grad_bytes))
    p = Problem(nodes, (Edge(0, 1), Edge(0, 2)), num_stages=2, allow_empty_stages=True)
    exact = exact_groups(p)
    assert (exact.group_of[2] == exact.group_of[0]) == (grad_bytes == 0)
    coarse = coarsen(p, cap_s=1.0).coarse_problem()
    assert max(n.grad_bytes for n in coarse.nodes) == max(30, grad_bytes)
