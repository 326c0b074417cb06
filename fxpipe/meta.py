"""Every ``node.meta`` key fxpipe writes, and the record type stored under it.

Passes fill these records; cost models, the lowering to a partition problem and
codegen read them. Nothing else in fxpipe touches ``node.meta`` by string.

    from fxpipe import meta
    meta.FLOPS.set(node, meta.FlopInfo(forward=..., backward=...))
    flops = meta.FLOPS.get(node)        # raises MissingMeta if the pass did not run
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import torch.fx

if TYPE_CHECKING:
    from fxpipe.runtime.recompute import Kept

__all__ = [
    "ATTENTION",
    "BYTES",
    "COPY_OF",
    "FLOPS",
    "MEASURED_MEMORY",
    "MODULE",
    "SHAPE",
    "SHARD",
    "TIME",
    "FlopInfo",
    "MeasuredMemory",
    "MemoryInfo",
    "MetaKey",
    "MissingMeta",
    "ModuleInfo",
    "ShardInfo",
    "TensorSpec",
    "TimeInfo",
    "ValueInfo",
]

R = TypeVar("R")


class MissingMeta(KeyError):
    """A pass that reads a record ran before the pass that writes it."""


@dataclass(frozen=True)
class MetaKey(Generic[R]):
    """A typed ``node.meta`` slot: its string key and the record class stored there."""

    name: str
    record: type[R]
    filled_by: str

    def get(self, node: torch.fx.Node) -> R:
        value = node.meta.get(self.name)
        if not isinstance(value, self.record):
            raise MissingMeta(
                f"{node.format_node()} has no {self.name!r} record; run {self.filled_by} first"
            )
        return value

    def has(self, node: torch.fx.Node) -> bool:
        return isinstance(node.meta.get(self.name), self.record)

    def set(self, node: torch.fx.Node, value: R) -> None:
        assert isinstance(value, self.record), (self.name, type(value))
        node.meta[self.name] = value


@dataclass(frozen=True)
class TensorSpec:
    """Shape and type of one tensor value (no storage, works for meta and fake tensors)."""

    shape: tuple[int, ...]
    dtype: str  # e.g. "float32", the torch dtype name without the "torch." prefix
    nbytes: int
    requires_grad: bool


@dataclass(frozen=True)
class ValueInfo:
    """Every tensor a node produces, in pytree-leaf order (one for a plain tensor)."""

    tensors: tuple[TensorSpec, ...]
    # The value is a tensor itself, not a tuple or list of them (a higher-order op such as
    # ``wrap_with_set_grad_enabled`` returns a one-tensor tuple, which has no ``size``).
    single: bool = True

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def requires_grad(self) -> bool:
        return any(t.requires_grad for t in self.tensors)


@dataclass(frozen=True)
class ModuleInfo:
    """The innermost ``nn.Module`` a node came from ("" is the root model)."""

    path: str  # qualified name, e.g. "transformer.h.3.attn"
    type_name: str  # class name, e.g. "GPT2Attention"
    stack: tuple[str, ...] = ()  # enclosing qualified names, outermost first, path last


@dataclass(frozen=True)
class FlopInfo:
    """Floating-point operations of one node for one micro-batch."""

    forward: int
    backward: int  # gradients of every input and parameter that requires grad
    # The part of ``backward`` that computes parameter gradients (W, deferrable in a
    # zero-bubble schedule); the rest is the input gradient (B, on the critical path). A
    # linear's backward is two GEMMs, dX = dY W (B) and dW = dY^T X (W); ops without
    # parameters are all B.
    backward_weight: int = 0

    @property
    def backward_input(self) -> int:
        return self.backward - self.backward_weight

    @property
    def weight_share(self) -> float:
        """The share of the backward's FLOPs that is W (0 for a backward without FLOPs)."""
        return self.backward_weight / self.backward if self.backward else 0.0


@dataclass(frozen=True)
class MemoryInfo:
    """Bytes a node owns or produces for one micro-batch."""

    param_bytes: int  # parameters this node reads directly (get_attr / call_module)
    buffer_bytes: int  # buffers this node reads directly
    output_bytes: int  # bytes of everything it returns
    saved_bytes: int  # bytes autograd keeps for backward (excluding parameters)
    # what a stage recomputed selectively may keep of it: the outputs of its matmuls and fused
    # attention (fxpipe.runtime.recompute.SELECTIVE_KEEPS), each with the work it would take
    # to run again per element; those its rule keeps, its backward does not rerun
    selective: tuple[Kept, ...] = ()
    # the (work, width) of those outputs it writes into in place, which SAC would hand the
    # backward written: no keep level of the model keeps outputs of these, every level's
    # rule skips them (fxpipe.lower.keep_levels)
    writes_kept: tuple[tuple[int, int], ...] = ()
    # (canonical qualified name, bytes) of those parameters and buffers. A tied parameter
    # has one canonical name (its first in ``named_parameters()``) whichever name a node uses.
    params: tuple[tuple[str, int], ...] = field(default=())
    buffers: tuple[tuple[str, int], ...] = field(default=())

    @property
    def selective_bytes(self) -> int:
        """The bytes a stage recomputed selectively keeps of it when it keeps them all."""
        return sum(kept.nbytes for kept in self.selective)


@dataclass(frozen=True)
class TimeInfo:
    """Seconds one node takes for one micro-batch."""

    forward_s: float
    backward_s: float  # the whole backward: input gradient (B) + weight gradient (W)
    source: str  # "analytic:<device>", "measured:cuda", "measured:cpu"
    backward_weight_s: float = 0.0  # the W part of ``backward_s`` (see ``FlopInfo``)
    # Calibration's factor on the host time torch's SAC adds to the node (``lower``): the
    # measured over the planned forward of the stage it was measured on.
    host_scale: float = 1.0

    @property
    def backward_input_s(self) -> float:
        return self.backward_s - self.backward_weight_s


@dataclass(frozen=True)
class MeasuredMemory:
    """Caching-allocator figures for one node, measured on a device."""

    kept_bytes: int  # allocated by the node and still held after it returns
    peak_bytes: int  # peak increase while it ran


@dataclass(frozen=True)
class ShardInfo:
    """How an op runs on the t GPUs of a host under tensor parallelism (Megatron-LM's
    layout, ``fxpipe.passes.tensor_parallel``): its role, and its group's key and size."""

    # "column": a linear whose output features are split; "inside": an op between a
    # pair's column and row linears, on split values (views, elementwise, attention);
    # "row": the linear that reduces a pair back to the model width, its output summed
    # over the t GPUs; "vocab_embedding" / "vocab_head": the token embedding and the LM
    # head, split by vocabulary rows; "replicated": every GPU runs it whole
    role: str
    group: str = ""  # the pair's row linear (a vocabulary-parallel op: itself); "" if none
    # the pieces the group splits into, which a TP degree must divide: the attention heads
    # and KV heads' common divisor, an MLP's hidden width; 0: any degree (the vocabulary,
    # padded as Megatron pads it, or a replicated op)
    units: int = 0


SHAPE = MetaKey("fxpipe.shape", ValueInfo, "fxpipe.passes.shapes.annotate_shapes")
MODULE = MetaKey("fxpipe.module", ModuleInfo, "fxpipe.passes.modules.annotate_modules")
FLOPS = MetaKey("fxpipe.flops", FlopInfo, "fxpipe.passes.flops.annotate_flops")
BYTES = MetaKey("fxpipe.bytes", MemoryInfo, "fxpipe.passes.memory.annotate_memory")
TIME = MetaKey("fxpipe.time", TimeInfo, "a cost model's annotate_times")
# On a node of a layer that tracing copied rather than traced (fxpipe.tracing.repeats):
# the name of the node of the traced layer it copies, which runs as it does.
COPY_OF = MetaKey("fxpipe.copy_of", str, "fxpipe.tracing.repeats.copy_layers")
# On an attention call that tracing made the call the model makes eagerly
# (fxpipe.tracing.attention): what changed, in order ("causal", "full", "grouped").
ATTENTION = MetaKey("fxpipe.attention", tuple, "fxpipe.tracing.attention.attention_calls")
SHARD = MetaKey("fxpipe.shard", ShardInfo,
                "fxpipe.passes.tensor_parallel.annotate_tensor_parallel")
MEASURED_MEMORY = MetaKey(
    "fxpipe.measured_memory", MeasuredMemory, "fxpipe.cost_models.measured.annotate_times"
)
