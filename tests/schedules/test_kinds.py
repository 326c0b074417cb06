"""The schedule kinds' one owner, ``fxpipe.schedules.KINDS``: every kind's table agrees with
its bubble formula and its in-flight rule, and the CLI, the report and the solver read it."""

from __future__ import annotations

import argparse
from fractions import Fraction

import pytest
import torch.distributed.pipelining as pipelining

from fxpipe import cli
from fxpipe.partition import Edge, Node, Problem
from fxpipe.partition.problem import stage_flights
from fxpipe.schedules import (
    KINDS,
    ScheduleKind,
    Table,
    interleaved_devices,
    kind_of,
    peak_in_flight,
    v_devices,
)

# K: stage modules, N: GPUs (pipeline positions), v: stage modules per GPU, M: micro-batches.


def sizes(kind: ScheduleKind) -> list[tuple[int, int, int]]:
    """(N, v, M) to try: interleaved needs v > 1 and M a multiple of N; the V kinds two
    stage modules per GPU and, for the zero-bubble formula, M >= 2N (ZB-H1: M >= N)."""
    if KINDS[kind].interleaved:
        return [(n, v, n * c) for n in (1, 2, 3, 4) for v in (2, 3) for c in (1, 2, 3)]
    if KINDS[kind].v_placed:
        return [(n, 2, m) for n in (1, 2, 3, 4) for m in (2 * n, 2 * n + 1, 3 * n)]
    if KINDS[kind].splits_backward:
        return [(n, 1, m) for n in (1, 2, 3, 5) for m in (n, n + 2, 2 * n)]
    return [(n, 1, m) for n in (1, 2, 3, 5) for m in (1, 2, 4, 7)]


def idle_shares(table: Table, devices: tuple[int, ...], positions: int) -> list[Fraction]:
    """Per GPU, the share of the step's ticks it runs nothing (unit-time actions)."""
    busy = [0] * positions
    for tick in table:
        for j, _kind, _m in tick:
            busy[devices[j]] += 1
    return [Fraction(len(table) - b, len(table)) for b in busy]


@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_simulated_bubble_is_the_kinds_formula(kind: ScheduleKind) -> None:
    spec = KINDS[kind]
    for n, v, m in sizes(kind):
        table = spec.table(n * v, v, m)
        devices = interleaved_devices(n, v) if spec.interleaved else tuple(range(n))
        if spec.v_placed:
            devices = v_devices(n)
        shares = idle_shares(table, devices, n)
        expected = spec.bubble_fraction(n, v, m)
        # every GPU idles the same share of the step, the formula's
        assert [float(s) for s in shares] == pytest.approx([expected] * n), (kind, n, v, m)
        # a forward and a backward (or its I and W) per micro-batch per stage module
        busy = (3 if spec.splits_backward else 2) * v * m
        ratio = Fraction(len(table) - busy, busy)
        assert float(ratio) == pytest.approx(spec.bubble_ratio(n, v, m)), (kind, n, v, m)


@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_in_flight_rule_is_what_the_table_holds(kind: ScheduleKind) -> None:
    spec = KINDS[kind]
    for n, v, m in sizes(kind):
        k = n * v
        assert spec.flights(k, v, m) == tuple(peak_in_flight(spec.table(k, v, m), k))


def test_problem_reads_the_in_flight_rule() -> None:
    nodes = tuple(Node(f"n{i}", 1.0, 2.0) for i in range(8))
    edges = tuple(Edge(i, i + 1) for i in range(7))
    for kind in ScheduleKind:
        v = 2 if KINDS[kind].interleaved or KINDS[kind].v_placed else 1
        problem = Problem(nodes=nodes, edges=edges, num_stages=4, schedule=kind,
                          microbatches=4, virtual_stages=v)
        table = KINDS[kind].table(4, v, 4)
        assert stage_flights(problem) == tuple(peak_in_flight(table, 4))


def test_kinds_differ_where_they_should() -> None:
    # GPipe holds every micro-batch, 1F1B only its warm-up: the solver must see the difference
    assert KINDS[ScheduleKind.GPIPE].flights(3, 1, 4) == (4, 4, 4)
    assert KINDS[ScheduleKind.ONE_F_ONE_B].flights(3, 1, 4) == (3, 2, 1)
    assert [kind for kind in ScheduleKind if KINDS[kind].stashes_weights] == [
        ScheduleKind.PIPEDREAM]
    assert [kind for kind in ScheduleKind if KINDS[kind].interleaved] == [
        ScheduleKind.INTERLEAVED]


def test_every_kind_has_a_spec_and_a_known_torch_schedule() -> None:
    assert set(KINDS) == set(ScheduleKind)
    for kind, spec in KINDS.items():
        assert kind.spec is spec
        if spec.torch_class is not None:
            assert isinstance(getattr(pipelining, spec.torch_class), type), kind


def test_cli_schedule_choices_are_the_kinds() -> None:
    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    split = commands.choices["split"]
    option = next(a for a in split._actions if "--schedule" in a.option_strings)
    assert option.choices is not None
    assert tuple(option.choices) == tuple(kind.value for kind in ScheduleKind)


def test_unknown_kind_names_every_kind() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zb'") as info:
        kind_of("zb")
    for kind in ScheduleKind:
        assert repr(kind.value) in str(info.value)
    assert kind_of("1f1b") is ScheduleKind.ONE_F_ONE_B
