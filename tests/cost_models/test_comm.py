import pytest

from fxpipe.cost_models import (
    DEVICES,
    allreduce_time,
    inter_node_time,
    intra_node_time,
    link_time,
    transfer_time,
)


def test_transfer_time_is_bytes_over_bandwidth_plus_latency() -> None:
    assert transfer_time(1_000_000, 1e9, 5e-6) == pytest.approx(1e-3 + 5e-6)


def test_nothing_to_send_costs_nothing() -> None:
    assert transfer_time(0, 1e9, 5e-6) == 0.0
    assert allreduce_time(0, 8, 1e9, 5e-6) == 0.0


def test_transfer_time_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="negative"):
        transfer_time(-1, 1e9, 0.0)
    with pytest.raises(ValueError, match="bandwidth"):
        transfer_time(1, 0.0, 0.0)


def test_device_links() -> None:
    h100 = DEVICES["h100"]
    nbytes = 64 * 2**20
    intra = nbytes / h100.intra_node_bandwidth + h100.intra_node_latency
    inter = nbytes / h100.inter_node_bandwidth + h100.inter_node_latency
    assert intra_node_time(nbytes, h100) == pytest.approx(intra)
    assert inter_node_time(nbytes, h100) == pytest.approx(inter)
    assert link_time(nbytes, h100) == pytest.approx(intra)
    assert link_time(nbytes, h100, same_node=False) == pytest.approx(inter)
    assert inter > intra


def test_ring_allreduce() -> None:
    # r = 4: 2·3/4 · 8e6 B / 1e9 B/s + 6 · 1e-5 s
    assert allreduce_time(8_000_000, 4, 1e9, 1e-5) == pytest.approx(0.012 + 6e-5)
    assert allreduce_time(8_000_000, 1, 1e9, 1e-5) == 0.0
    with pytest.raises(ValueError, match="at least one rank"):
        allreduce_time(1, 0, 1e9, 0.0)
