"""Communication time: bytes / bandwidth + latency.

Legend: r: number of ranks in a collective, bw: link bandwidth (B/s, one
direction), lat: per-message latency (s).
"""

from __future__ import annotations

from fxpipe.collectives import ring_allreduce_s
from fxpipe.cost_models.devices import Device

__all__ = [
    "allreduce_time",
    "inter_node_time",
    "intra_node_time",
    "link_time",
    "transfer_time",
]


def transfer_time(nbytes: int, bandwidth: float, latency: float) -> float:
    """Seconds to send ``nbytes`` point to point: ``nbytes / bandwidth + latency``.

    Nothing to send costs nothing (no message is sent, so no latency either).
    """
    _check(nbytes, bandwidth, "send")
    if nbytes == 0:
        return 0.0
    return nbytes / bandwidth + latency


def _check(nbytes: int, bandwidth: float, verb: str) -> None:
    """Refuse a negative byte count (to ``verb``) and a bandwidth that is not positive."""
    if nbytes < 0:
        raise ValueError(f"cannot {verb} a negative number of bytes ({nbytes})")
    if bandwidth <= 0:
        raise ValueError(f"link bandwidth must be positive, got {bandwidth} B/s")


def intra_node_time(nbytes: int, device: Device) -> float:
    """Seconds to send ``nbytes`` to a peer device in the same host (NVLink / PCIe)."""
    return transfer_time(nbytes, device.intra_node_bandwidth, device.intra_node_latency)


def inter_node_time(nbytes: int, device: Device) -> float:
    """Seconds to send ``nbytes`` to a peer device in another host (the NIC)."""
    return transfer_time(nbytes, device.inter_node_bandwidth, device.inter_node_latency)


def link_time(nbytes: int, device: Device, *, same_node: bool = True) -> float:
    """``intra_node_time`` or ``inter_node_time``, by where the peer is."""
    return intra_node_time(nbytes, device) if same_node else inter_node_time(nbytes, device)


def allreduce_time(nbytes: int, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``ranks`` ranks
    (``fxpipe.collectives.ring_allreduce_s``). One rank, or nothing to reduce, costs
    nothing.
    """
    if ranks < 1:
        raise ValueError(f"an all-reduce needs at least one rank, got {ranks}")
    _check(nbytes, bandwidth, "all-reduce")
    if nbytes == 0:
        return 0.0
    return ring_allreduce_s(nbytes, ranks, bandwidth, latency)
