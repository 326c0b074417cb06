"""The solver's user errors: typed, carrying their figures, worded in the solver's terms
(the CLI words the same figures with its flags: tests/test_error_table.py)."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from fxpipe.partition import (
    Edge,
    InfeasibleMemoryError,
    Node,
    NoSolutionError,
    PipedreamTieError,
    Problem,
    ProblemTooLargeError,
    Recompute,
    TooManyStagesError,
    nothing_fits,
    partition,
)
from fxpipe.partition.coarsen import exact_groups
from fxpipe.partition.nothing_fits import min_memory
from fxpipe.partition.solve import OP_BYTES
from fxpipe.schedules import ScheduleKind

GiB = 2**30


def chain(n: int, **kwargs: object) -> Problem:
    nodes = tuple(Node(f"n{i}", 1, 1) for i in range(n))
    return Problem(nodes, tuple(Edge(i, i + 1) for i in range(n - 1)), **kwargs)  # type: ignore[arg-type]


def test_more_stages_than_nodes() -> None:
    with pytest.raises(TooManyStagesError) as info:
        partition(chain(3, num_stages=8))
    e = info.value
    assert (e.stages, e.nodes, e.most, e.virtual_stages) == (8, 3, 3, 1)
    assert str(e) == "cannot cut 3 nodes into 8 stages; use 3 stages or fewer"
    assert isinstance(e, ValueError)
    assert "--" not in str(e)  # no CLI flag names below the CLI


def test_more_stages_than_colocated_groups() -> None:
    nodes = tuple(Node(f"n{i}", 1, 1) for i in range(4))
    p = Problem(nodes, (Edge(0, 1), Edge(1, 2), Edge(2, 3)), num_stages=3, colocate=((0, 3),))
    with pytest.raises(TooManyStagesError, match=r"only 1 groups .* use 1 stages or fewer") as info:
        partition(p)
    assert (info.value.stages, info.value.nodes, info.value.groups, info.value.most) == (3, 4, 1, 1)


def test_more_stage_modules_than_nodes() -> None:
    p = chain(3, num_stages=4, virtual_stages=2, schedule=ScheduleKind.INTERLEAVED, microbatches=2)
    with pytest.raises(TooManyStagesError) as info:
        partition(p)
    e = info.value
    assert (e.stages, e.devices, e.virtual_stages, e.most) == (4, 2, 2, 3)
    assert str(e) == ("cannot cut 3 nodes into 4 stage modules (2 GPUs x 2 virtual stages); "
                      "use fewer GPUs or virtual stages")


def test_no_split_fits_memory_says_what_would() -> None:
    # 8 layers of 6.6 GiB onto 4 GPUs: two per GPU needs 13.2 GiB.
    size = round(6.6 * GiB)
    nodes = tuple(Node(f"n{i}", 1, 1, param_bytes=size) for i in range(8))
    p = Problem(nodes, tuple(Edge(i, i + 1) for i in range(7)), num_stages=4,
                memory_limit=10 * GiB, state_factor=1.0)
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(p, time_limit_s=10)
    e = info.value
    assert (e.devices, e.limit, e.needed) == (4, 10 * GiB, 2 * size)
    # one layer per GPU fits, and no fewer GPUs can hold 8 layers in 10 GiB each
    assert (e.fits_on, e.recompute) == (8, None)
    assert str(e) == (
        "no split of the model onto 4 GPUs fits in 10.0 GiB per GPU; the best split needs "
        "13.2 GiB; to fit, allow 13.2 GiB per GPU or use 8 GPUs with M = 1 micro-batch")
    assert "--" not in str(e)


def test_no_split_fits_says_recompute_would() -> None:
    # 4 layers keeping 3 GiB of activations per micro-batch, 4 in flight on stage 0 of
    # 1F1B: 12 GiB without recompute; recomputing keeps only the 1 KiB received values.
    nodes = tuple(Node(f"n{i}", 1, 1, activation_bytes=3 * GiB, output_bytes=1024)
                  for i in range(4))
    p = Problem(nodes, tuple(Edge(i, i + 1) for i in range(3)), num_stages=4,
                memory_limit=8 * GiB, schedule=ScheduleKind.ONE_F_ONE_B, microbatches=8)
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(p, time_limit_s=10)
    assert info.value.recompute == "auto"
    assert str(info.value).endswith("or recompute (auto)")
    # and the same problem with the solver choosing recompute does fit
    partition(replace(p, recompute=Recompute.AUTO), time_limit_s=10)


def test_the_fewest_gpus_search_stops_at_eight_times_the_gpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 300 layers keeping 1 GiB each per micro-batch, no recompute, 1F1B with M = 300: stage
    # 0 of n holds n micro-batches of at least one layer, so n <= 10, and ten stages hold
    # at most 10 * (1 + 1/2 + ... + 1/10) = 29 layers: no count fits. The search tries up
    # to 8 x 8 GPUs, not the 300 there can be (on Llama-3-70B the DP at 4,096 stages alone
    # took 150 s), and says how far it looked.
    nodes = tuple(Node(f"n{i}", 1, 1, activation_bytes=GiB, output_bytes=1024)
                  for i in range(300))
    p = Problem(nodes, tuple(Edge(i, i + 1) for i in range(299)), num_stages=4,
                memory_limit=10 * GiB, schedule=ScheduleKind.ONE_F_ONE_B, microbatches=300)
    tried: list[int] = []
    dp_fits = nothing_fits.dp_fits
    monkeypatch.setattr(nothing_fits, "dp_fits",
                        lambda q: tried.append(q.num_stages) or dp_fits(q))
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(p, time_limit_s=10)
    e = info.value
    assert (e.fits_on, e.at_least, e.searched) == (None, None, 64)
    assert max(tried) == 64
    # the leanest 4 stages hold 36, 48, 72 and 144 layers, 144 GiB each with 4, 3, 2, 1 in flight
    assert str(e).endswith("needs 144.0 GiB, and none was found on up to 64 GPUs; to fit, "
                           "allow 144.0 GiB per GPU")


@pytest.mark.parametrize("needed_gib", [None, 0.5, 40.0, 66.0, 400.0])
def test_the_fewest_gpus_from_the_memory_needed_are_the_fewest_that_fit(
        needed_gib: float | None) -> None:
    """Started from the count the memory needed suggests, the search answers the fewest
    count on which the DP fits, whether the guess is right, low or far too high."""
    # 24 layers keeping 1 GiB each per micro-batch, 1F1B (M = 24), 12 GiB per GPU: stage j of
    # n keeps n - j micro-batches, so 5 stages or fewer hold too few layers, and from 12
    # on stage 0 cannot hold even one. The guesses: 2 x needed / 12 GiB = 3 (low), 7 and
    # 11 (high, in the range), 67 (past it, taken as 24: only the search up from 2 finds 6).
    nodes = tuple(Node(f"n{i}", 1, 1, activation_bytes=GiB, output_bytes=1024)
                  for i in range(24))
    p = Problem(nodes, tuple(Edge(i, i + 1) for i in range(23)), num_stages=2,
                memory_limit=12 * GiB, schedule=ScheduleKind.ONE_F_ONE_B, microbatches=24)
    fit = [n for n in range(2, 25)
           if nothing_fits.dp_fits(replace(p, num_stages=n, num_devices=0))]
    assert fit == list(range(6, 12))
    needed = None if needed_gib is None else needed_gib * GiB
    assert nothing_fits._fewest_gpus(p, needed)[0] == 6


def test_min_memory_is_a_split_that_fits_when_the_search_runs_out_of_time() -> None:
    # With no time the memory program finds nothing and proves only 0 B; the answer is
    # then the leanest split the interval DP found, never 0 B.
    size = round(6.6 * GiB)
    nodes = tuple(Node(f"n{i}", 1, 1, param_bytes=size, activation_bytes=1000 * i)
                  for i in range(40))
    p = Problem(nodes, tuple(Edge(i, i + 1) for i in range(39)), num_stages=4,
                memory_limit=10 * GiB, state_factor=1.0)
    needed = min_memory(p, exact_groups(p), work_limit=0.0, time_limit_s=0.0, workers=1)
    assert 10 * size <= needed < 11 * size  # 40 layers on 4 GPUs: at least 10 on one


def test_no_solution_says_which_limit_ended_the_search() -> None:
    # Built directly: a solver that finds nothing in time is not reproducible in a test.
    e = NoSolutionError(devices=4, work_limit=10, time_limit_s=0.5, wall_clock=True,
                        limit=8 * GiB)
    assert (e.devices, e.work_limit, e.time_limit_s, e.wall_clock, e.limit) == (
        4, 10, 0.5, True, 8 * GiB)
    assert str(e) == ("no split that fits in 8.0 GiB per GPU was found in 0.5 s of wall "
                      "clock; allow the solver more time or more memory")
    anywhere = NoSolutionError(devices=4, work_limit=2.5, time_limit_s=30, wall_clock=False,
                               limit=None)
    assert str(anywhere) == ("no split onto 4 GPUs was found within a work limit of 2.5; "
                             "allow the solver more work")
    assert isinstance(anywhere, ValueError)
    leaner = NoSolutionError(devices=4, work_limit=10, time_limit_s=30, wall_clock=False,
                             limit=8 * GiB, leanest=9.5 * GiB)
    assert leaner.leanest == 9.5 * GiB
    assert str(leaner) == ("no split that fits in 8.0 GiB per GPU was found within a work "
                           "limit of 10; allow the solver more work or more memory (the "
                           "leanest split found needs 9.5 GiB)")


def test_no_nodes_at_all_is_not_a_stage_count_to_lower() -> None:
    with pytest.raises(TooManyStagesError) as info:
        partition(Problem((), (), num_stages=2))
    assert (info.value.nodes, info.value.most) == (0, 0)
    assert str(info.value) == (
        "the model has no operations to cut into stages (forward returns its inputs or "
        "constants); give it layers, or run it without a pipeline")  # not "use 0 stages"


def test_too_many_nodes_for_the_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fxpipe.partition.solve.MAX_NODES", 2)
    with pytest.raises(ProblemTooLargeError) as info:
        partition(chain(3, num_stages=2))
    e = info.value
    assert (e.nodes, e.most, e.needs_bytes, e.block) == (3, 2, 3 * OP_BYTES, 0)
    assert str(e) == (
        "the model has 3 ops, more than the 2 the solver handles: its memory grows with the "
        "op count (3 ops would need 48.0 KiB); plan a smaller model with the same blocks, "
        "e.g. fewer layers")
    assert isinstance(e, ValueError) and "--" not in str(e)


def test_a_chain_longer_than_the_block_limit_is_planned(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Reachability is kept per block between two ops no value skips: a chain's blocks
    are two ops, however long it is."""
    monkeypatch.setattr("fxpipe.partition.solve.MAX_BLOCK", 2)
    assert partition(chain(6, num_stages=2)).stage_of == (0, 0, 0, 1, 1, 1)


def test_a_block_too_long_for_the_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    """An edge from the first op to the last makes one block of the whole graph."""
    monkeypatch.setattr("fxpipe.partition.solve.MAX_BLOCK", 5)
    problem = chain(6, num_stages=2)
    problem = replace(problem, edges=(*problem.edges, Edge(0, 5)))
    with pytest.raises(ProblemTooLargeError) as info:
        partition(problem)
    e = info.value
    assert (e.nodes, e.most, e.needs_bytes, e.block) == (6, 5, 9 * 6**2, 6)
    assert str(e) == (
        "the model has 6 ops between two that no value skips (one made early and read late: "
        "a skip over the model), more than the 5 the solver handles: its memory grows with "
        "the square of that count (6 ops would need 324 B); plan a smaller model with the "
        "same blocks, e.g. fewer layers")


def test_pipedream_tie_carries_its_share() -> None:
    e = PipedreamTieError(name="embed.weight", share=1.0, stages=2)
    assert (e.name, e.share, e.stages) == ("embed.weight", 1.0, 2)
    assert "100% of the model's time, and 2 stages cannot balance" in str(e)
    assert isinstance(e, ValueError) and "--" not in str(e)


def test_no_cp_sat_program_beyond_huge_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory blow-up of GPipe's Transformer-L at 2,975 layers onto 128 (21.5 GB): the
    interval DP found no split, the block bound proved none impossible, and CP-SAT's
    program over 59,000 groups x 128 stages was built. Here on a small scale, with
    HUGE_MODEL set below the program's size and a bound that proves nothing: no program
    is built, and the error says only the DP looked."""
    from fxpipe.partition import solve

    built: list[int] = []

    class Counted(solve.StageModel):  # type: ignore[misc]
        def __init__(self, exact: object, **kwargs: object) -> None:
            built.append(1)
            super().__init__(exact, **kwargs)

    monkeypatch.setattr(solve, "StageModel", Counted)
    monkeypatch.setattr(solve, "HUGE_MODEL", 10)
    monkeypatch.setattr(solve, "block_bound", lambda exact, upper_s=0.0: 0.0)
    # 13 layers of 1 GiB on 3 GPUs of 4.5 GiB: no split fits (5 layers on one at least),
    # the parameters spread evenly would (4.3 GiB), and the stand-in bound does not say
    nodes = tuple(Node(f"n{i}", 1, 1, param_bytes=GiB) for i in range(13))
    p = Problem(nodes, tuple(Edge(i, i + 1) for i in range(12)), num_stages=3,
                memory_limit=4.5 * GiB, state_factor=1.0)
    with pytest.raises(NoSolutionError) as caught:
        partition(p, time_limit_s=10)
    assert not built
    assert "by the interval DP (a program of 39 placement variables is too big for CP-SAT)" \
        in str(caught.value)
    assert "allow more memory (the leanest split found needs" in str(caught.value)
    # and where the DP has a split: it stands, with the bound's gap, and no program either
    fits = partition(replace(p, memory_limit=8 * GiB), time_limit_s=10)
    assert not built
    assert fits.report.method == "interval-dp" and fits.phases == ()
    assert fits.report.bound <= fits.report.objective


@pytest.mark.parametrize("error", [
    TooManyStagesError(stages=8, nodes=3, groups=3, devices=8),
    PipedreamTieError(name="embed.weight", share=0.4, stages=4),
    ProblemTooLargeError(nodes=30_000, most=20_000, needs_bytes=11 * GiB),
    InfeasibleMemoryError(devices=2, limit=GiB, needed=3 * GiB, fits_on=8, precision="bf16-true"),
    NoSolutionError(devices=4, work_limit=2.0, time_limit_s=60.0, wall_clock=False,
                    limit=GiB, leanest=2 * GiB),
], ids=lambda e: type(e).__name__)
def test_each_error_crosses_processes_with_its_figures(error: ValueError) -> None:
    """A split run in a multiprocessing pool raises the same error in the parent: each was
    pickled as ``cls(message)``, which its keyword-only figures refused, and the pool
    raised its own error instead."""
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert vars(again) == vars(error)
