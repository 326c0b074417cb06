"""NodeCosts: the one place the solver adds up its nodes' costs, and every reader of it.

Each sum over nodes, per stage, coarse group or group of an order, is ``NodeCosts.by``'s:
the same float, to the bit, as a running total in node order (the plans do not move), and
no other module of the solver adds a node's cost field up itself."""

from __future__ import annotations

import ast
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fxpipe.partition import Edge, Node, Problem, Recompute, evaluate
from fxpipe.partition.baselines import Blocks
from fxpipe.partition.chain import group_sums
from fxpipe.partition.coarsen import coarsen, exact_groups
from fxpipe.partition.cost import NodeCosts, prefix_sums
from fxpipe.partition.evaluate import stage_sums
from fxpipe.partition.ilp_inputs import group_costs

PARTITION = Path(__file__).resolve().parents[2] / "fxpipe" / "partition"
# Node's cost fields that a stage, group or block adds up (or takes the largest of)
SUMMED = {"forward_s", "backward_s", "backward_weight_s", "activation_bytes",
          "deferred_bytes", "grad_bytes", "selective_bytes", "selective_kept_s",
          "selective_host_s"}
NODES = {"nodes", "fine"}  # what the solver's modules name a list of nodes


def chain(n: int, seed: int, levels: int = 2) -> Problem:
    """A chain of n nodes with costs that do not add up exactly in floating point."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        forward = rng.uniform(1e-6, 1e-3)
        kept_s = tuple(rng.uniform(0, forward) for _ in range(rng.randint(0, levels)))
        nodes.append(Node(
            f"n{i}", forward, rng.uniform(1e-6, 2e-3), param_bytes=rng.randrange(10**9),
            activation_bytes=rng.randrange(10**8), grad_bytes=rng.randrange(10**7),
            output_bytes=rng.randrange(10**6), returned=i == n - 1,
            backward_weight_s=rng.uniform(0, 1e-4), deferred_bytes=rng.randrange(10**5),
            selective_bytes=tuple(rng.randrange(10**6) for _ in kept_s),
            selective_kept_s=kept_s, selective_host_s=rng.choice([0.0, rng.uniform(0, 1e-4)])))
    levels_ = tuple((w, 0) for w in range(levels))
    return Problem(tuple(nodes), tuple(Edge(i, i + 1) for i in range(n - 1)), num_stages=4,
                   keep_levels=levels_, microbatches=8, recompute=Recompute.AUTO)


def running_totals(problem: Problem, part_of: list[int], parts: int) -> dict[str, list]:
    """The sums as a loop adds them, one node after the other."""
    levels = len(problem.keep_levels)
    out: dict[str, list] = {name: [0.0] * parts for name in (
        "compute_s", "forward_s", "backward_s", "backward_weight_s", "params", "activations",
        "returned", "deferred", "transient")}
    out["selective"] = [[0.0] * levels for _ in range(parts)]
    out["selective_again_s"] = [[0.0] * levels for _ in range(parts)]
    for node, j in zip(problem.nodes, part_of, strict=True):
        out["compute_s"][j] += node.forward_s + node.backward_s
        out["forward_s"][j] += node.forward_s
        out["backward_s"][j] += node.backward_s
        out["backward_weight_s"][j] += node.backward_weight_s
        out["params"][j] += node.param_bytes
        out["activations"][j] += node.activation_bytes
        out["returned"][j] += node.output_bytes if node.returned else 0
        out["deferred"][j] += node.deferred_bytes
        out["transient"][j] = max(out["transient"][j], node.grad_bytes)
        for level in range(levels):
            kept, again = node.selective(level)
            out["selective"][j][level] += kept
            out["selective_again_s"][j][level] += again
    return out


@pytest.mark.parametrize("seed", range(5))
def test_by_part_is_the_running_total_to_the_bit(seed: int) -> None:
    problem = chain(60, seed)
    rng = random.Random(seed)
    part_of = [rng.randrange(5) for _ in problem.nodes]  # not contiguous, one part empty
    part_of = [j if j != 3 else 4 for j in part_of]
    got = NodeCosts.of(problem).by(part_of, 5)
    for name, want in running_totals(problem, part_of, 5).items():
        assert getattr(got, name).tolist() == want, name
    assert got.forward_s[3] == 0.0 and got.transient[3] == 0.0


def test_a_node_keeps_its_forward_at_a_level_it_has_no_entry_for() -> None:
    """``Node.selective``: without an entry for a level a node keeps nothing there and
    runs all of its forward again."""
    node = Node("a", 3.0, 1.0, selective_bytes=(5,), selective_kept_s=(2.0,))
    costs = NodeCosts.of(Problem((node,), (), num_stages=1, keep_levels=((1, 0), (0, 0))))
    assert costs.selective.tolist() == [[5.0, 0.0]]
    assert costs.selective_again_s.tolist() == [[1.0, 3.0]]


def test_every_reader_reads_the_same_sums() -> None:
    """evaluate's stage sums, the CP-SAT inputs per coarse group, the interval DP's
    prefix sums and the block bound's group sums are NodeCosts' rows."""
    problem = chain(40, 7)
    exact = exact_groups(problem)
    stage_of = [min(v // 10, 3) for v in range(40)]
    stages = NodeCosts.of(problem).by(stage_of, 4)
    for j, sums in enumerate(stage_sums(problem, stage_of)):
        assert (sums.forward_s, sums.own_params, sums.transient) == (
            stages.forward_s[j], stages.params[j], stages.transient[j])
        assert sums.selective_again_s == tuple(stages.selective_again_s[j])
    assert evaluate(problem, stage_of).stages[0].forward_s == stages.forward_s[0]

    coarse = coarsen(problem, base=exact)
    groups = NodeCosts.of(problem).by(coarse.group_of, coarse.num_coarse)
    inputs = group_costs(coarse, 10**6)
    assert inputs.secs == groups.compute_s.tolist()
    assert inputs.act == [int(b) for b in groups.activations]
    blocks = Blocks.of(coarse)
    assert np.array_equal(blocks.T, prefix_sums(groups.compute_s))
    assert np.array_equal(blocks.S, prefix_sums(groups.selective))

    by_exact = NodeCosts.of(problem).by(exact.group_of, exact.num_coarse)
    assert np.array_equal(group_sums(exact)[:, 0], by_exact.compute_s)


def _adds_up_a_node_field(tree: ast.AST) -> list[int]:
    """Lines that add a node's cost field to a running total in a loop over nodes
    (``for v, node in enumerate(p.nodes): x += node.forward_s``) or ``sum()`` one over
    nodes (``sum(n.forward_s for n in p.nodes)``)."""
    def reads(node: ast.AST, names: set[str]) -> bool:
        return any((isinstance(n, ast.Attribute) and n.attr in names)
                   or (isinstance(n, ast.Name) and n.id in names) for n in ast.walk(node))

    lines = []
    for loop in ast.walk(tree):
        if isinstance(loop, ast.For) and reads(loop.iter, NODES):
            lines += [n.lineno for n in ast.walk(loop) if isinstance(n, ast.AugAssign)
                      and isinstance(n.op, ast.Add) and reads(n.value, SUMMED)]
        elif (isinstance(loop, ast.Call) and isinstance(loop.func, ast.Name)
              and loop.func.id == "sum" and reads(loop, NODES)
              and any(reads(a, SUMMED) for a in loop.args)):
            lines.append(loop.lineno)
    return lines


def test_no_other_module_of_the_solver_adds_up_node_costs() -> None:
    found = {path.name: _adds_up_a_node_field(ast.parse(path.read_text(encoding="utf-8")))
             for path in sorted(PARTITION.glob("*.py")) if path.name != "cost.py"}
    assert not {name: lines for name, lines in found.items() if lines}


def test_a_problem_is_read_once_and_its_columns_stay_as_read() -> None:
    """``evaluate`` runs on many splits of one problem: its columns are read once, and
    no reader may write into them."""
    problem = chain(10, 3)
    costs = NodeCosts.of(problem)
    assert NodeCosts.of(problem) is costs
    with pytest.raises(ValueError, match="read-only"):
        costs.forward_s[0] = 0.0
    other = replace(problem, microbatches=4)  # equal nodes, another problem
    assert NodeCosts.of(other) is not costs
    assert NodeCosts.of(other).forward_s.tolist() == costs.forward_s.tolist()
