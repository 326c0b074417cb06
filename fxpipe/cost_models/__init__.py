"""Turn annotations into seconds.

- ``devices``: the device table (datasheet FLOP/s, memory, links) and ``get_device``.
- ``analytic``: a roofline per node from FLOPs, bytes moved and a ``Device``.
- ``measured``: run the graph once and time every node (CUDA events or wall clock).
- ``comm``: bytes / bandwidth + latency, and ring all-reduce.
- ``calibrate``: rescale node times (and saved bytes) by a training step's measured /
  predicted stage figures.
"""

from fxpipe.cost_models import analytic, calibrate, measured
from fxpipe.cost_models.comm import (
    allreduce_time,
    inter_node_time,
    intra_node_time,
    link_time,
    transfer_time,
)
from fxpipe.cost_models.devices import DEVICES, Device, UnknownDeviceError, get_device

__all__ = [
    "DEVICES",
    "Device",
    "UnknownDeviceError",
    "allreduce_time",
    "analytic",
    "calibrate",
    "get_device",
    "inter_node_time",
    "intra_node_time",
    "link_time",
    "measured",
    "transfer_time",
]
