"""The analytic cost model: a roofline per node from the device table.

    t = max(flops / peak_flops[dtype], bytes_moved / memory_bandwidth) + launch_overhead

for a node that does any work (flops or bytes moved > 0), else 0.

Forward: ``bytes_moved`` = bytes of the node's tensor inputs (their SHAPE
records) + bytes of its outputs + parameter and buffer bytes it reads itself
(its BYTES record; an ``nn.Module`` call). A ``get_attr`` parameter feeding an
aten op is an input, so it is counted once, as an input.

Backward, an assumption: it moves about twice the forward bytes (it reads the
output gradient and the saved inputs, writes the input gradients and, for a
layer, reads the weights again and writes their gradients) and does the
backward FLOPs of the FLOPS record. A node whose outputs do not require grad
has no backward.

The backward splits into the input gradient (B) and the weight gradient (W) by their
FLOPs (``FlopInfo.weight_share``): W gets that share of the backward's time. A backward
without FLOPs (a norm's or an activation's) is all B, weights or not: its weight
gradient is a reduction too small to schedule apart.

Free nodes: placeholders, ``get_attr``, ``output``, torch.export's
``_guards_fn`` input check, and view-like / metadata ops
that do no FLOPs (``view``, ``transpose``, ``getitem``, ``size``, ...): their
output aliases the input or is not a tensor, so nothing is moved.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from fxpipe import meta
from fxpipe.cost_models.devices import Device, get_device

__all__ = ["annotate_times", "bytes_moved", "is_free", "node_time", "roofline_time"]

# Backward bytes moved, as a multiple of the forward bytes (see the module docstring).
BACKWARD_BYTES_FACTOR = 2

_COMPUTING_OPS = ("call_module", "call_function", "call_method")
_EXPORT_GUARD = "_guards_fn"  # torch.export's input check, a call_module of no model code

# Ops the roofline prices at no bytes moved: views, and reads of metadata (not a tensor).
# Not passes/aliasing.py's VIEW_NAMES, which asks whether a result may share storage
# (``contiguous`` may, and is priced here, since it copies when it does not).
_FREE_NAMES = frozenset(
    {
        "alias",
        "as_strided",
        "detach",
        "dim",
        "expand",
        "expand_as",
        "flatten",
        "getitem",
        "narrow",
        "numel",
        "permute",
        "reshape",
        "select",
        "size",
        "slice",
        "split",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unflatten",
        "unsqueeze",
        "view",
        "view_as",
        "_unsafe_view",
        "_assert_tensor_metadata",
    }
)


def _target_name(node: torch.fx.Node) -> str:
    """The bare op name of a call: "view" for ``x.view`` and ``aten.view.default``."""
    target: Any = node.target
    if isinstance(target, str):
        return target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target._schema.name).split("::")[-1]
    return str(getattr(target, "__name__", ""))


def is_free(node: torch.fx.Node) -> bool:
    """True for nodes that cost nothing: non-computing ops and zero-FLOP views."""
    if node.op not in _COMPUTING_OPS or node.target == _EXPORT_GUARD:
        return True
    if node.op == "call_module":
        return False
    return meta.FLOPS.get(node).forward == 0 and _target_name(node) in _FREE_NAMES


def bytes_moved(node: torch.fx.Node) -> int:
    """Forward bytes read and written by ``node``, from its SHAPE and BYTES records."""
    if is_free(node):
        return 0
    inputs = sum(meta.SHAPE.get(arg).nbytes for arg in node.all_input_nodes)
    memory = meta.BYTES.get(node)
    return inputs + meta.SHAPE.get(node).nbytes + memory.param_bytes + memory.buffer_bytes


def roofline_time(
    flops: float, nbytes: float, *, device: Device, dtype: str, allow_tf32: bool = False
) -> float:
    """Seconds for one kernel doing ``flops`` and moving ``nbytes`` on ``device``."""
    if flops == 0 and nbytes == 0:
        return 0.0
    compute_s = flops / device.peak_flops(dtype, allow_tf32=allow_tf32)
    memory_s = nbytes / device.memory_bandwidth
    return max(compute_s, memory_s) + device.launch_overhead


def node_time(
    *,
    flops: meta.FlopInfo,
    nbytes: int,
    dtype: str,
    requires_grad: bool,
    device: Device,
    allow_tf32: bool = False,
) -> meta.TimeInfo:
    """Forward and backward seconds of one node from its FLOPs and forward bytes moved."""
    forward_s = roofline_time(
        flops.forward, nbytes, device=device, dtype=dtype, allow_tf32=allow_tf32
    )
    backward_s = 0.0
    if requires_grad:
        backward_s = roofline_time(
            flops.backward,
            BACKWARD_BYTES_FACTOR * nbytes,
            device=device,
            dtype=dtype,
            allow_tf32=allow_tf32,
        )
    return meta.TimeInfo(forward_s, backward_s, source=f"analytic:{device.name}",
                         backward_weight_s=backward_s * flops.weight_share)


def _dtype(node: torch.fx.Node) -> str:
    """The dtype the node computes in: its first floating output, else float32."""
    tensors = meta.SHAPE.get(node).tensors
    for spec in tensors:
        if spec.dtype.startswith(("float", "bfloat", "complex")):
            return spec.dtype
    return "float32"


def annotate_times(
    gm: torch.fx.GraphModule, device: Device | str, *, allow_tf32: bool = False
) -> torch.fx.GraphModule:
    """Write a roofline ``meta.TIME`` on every node of ``gm`` and return ``gm``.

    Reads the SHAPE, FLOPS and BYTES records of every computing node (run the
    shape, FLOP and memory passes first). ``allow_tf32`` prices float32 matmuls
    at the TF32 tensor-core peak, as PyTorch runs them with
    ``torch.backends.cuda.matmul.allow_tf32 = True``.
    """
    dev = get_device(device) if isinstance(device, str) else device
    source = f"analytic:{dev.name}"
    for node in gm.graph.nodes:
        if is_free(node):
            meta.TIME.set(node, meta.TimeInfo(0.0, 0.0, source=source))
            continue
        shape = meta.SHAPE.get(node)
        meta.TIME.set(
            node,
            node_time(
                flops=meta.FLOPS.get(node),
                nbytes=bytes_moved(node),
                dtype=_dtype(node),
                requires_grad=shape.requires_grad,
                device=dev,
                allow_tf32=allow_tf32,
            ),
        )
    return gm
