"""Attention masks that export builds from the input sizes, given back as ``is_causal``.

Eagerly, transformers calls ``scaled_dot_product_attention`` with ``is_causal=True`` and no
mask when nothing is padded, so the device runs its fused kernels (flash, on a GPU). Under
``torch.export`` it builds the causal mask instead (it will not let a traced graph rely on
``is_causal``), and every call gets a (batch, 1, seq, seq) tensor: a GPU runs the
memory-efficient kernel, which keeps an L x L copy of the mask per call for backward, and
every stage after the first receives the mask. The stages would train slower and hold more
than the model does, and the plan would say so.

So each mask that depends on the input sizes only (no value of any input, parameter or
buffer) is computed at several sizes on the CPU; where it lets each query see exactly the
keys up to its own position at every one of them, the calls that read it take
``is_causal=True`` and no mask; where it lets every query see every key, no mask. The sizes
checked exceed every integer constant of the mask's computation, so a sliding window,
an offset or a prefix shows as a mask that is not causal, and the mask is kept. A mask of
query and key lengths that may differ is kept.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

__all__ = ["MASK_GIVEN_BACK", "causal_masks", "describe_masks"]

MASK_GIVEN_BACK = "fxpipe.mask_given_back"  # node meta: "causal" or "full"

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_LARGEST = 512  # constants above this in a mask's computation: not checked, kept
_BATCH = 2  # the batch size the masks are computed at


def causal_masks(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm``'s attention calls as the module docstring says; returns how many."""
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _SDPA:
            mask = _argument(node, 3, "attn_mask")
            if isinstance(mask, torch.fx.Node) and not _argument(node, 5, "is_causal"):
                readers.setdefault(mask, []).append(node)
    rewritten, computed = 0, set()
    for mask, calls in readers.items():
        kind = _kind(mask, calls)
        if kind is None:
            continue
        for call in calls:
            args = list(call.args)
            kwargs = {k: v for k, v in call.kwargs.items() if k not in ("attn_mask", "is_causal")}
            del args[3:]
            kwargs["is_causal"] = kind == "causal"
            if call.args[4:5]:
                kwargs["dropout_p"] = call.args[4]
            call.args, call.kwargs = tuple(args), kwargs
            call.meta[MASK_GIVEN_BACK] = kind
            rewritten += 1
        computed |= _ancestors(mask)[0] or set()
    for node in reversed(gm.graph.nodes):
        if node in computed and not node.users and node.op != "placeholder":
            gm.graph.erase_node(node)
    gm.recompile()
    return rewritten


def describe_masks(gm: torch.fx.GraphModule) -> str | None:
    """The note for the attention calls ``causal_masks`` rewrote in ``gm``, if any."""
    kinds = [n.meta[MASK_GIVEN_BACK] for n in gm.graph.nodes if MASK_GIVEN_BACK in n.meta]
    if not kinds:
        return None
    causal = kinds.count("causal")
    said = [f"{causal} causal, now is_causal=True" if causal else "",
            f"{len(kinds) - causal} hiding nothing, now dropped" if len(kinds) > causal else ""]
    return (f"torch.export built the attention masks of {len(kinds)} calls from the input "
            f"sizes alone ({' and '.join(s for s in said if s)}, as checked at several "
            f"sizes): the same attention, as transformers runs it eagerly, on the fused "
            f"kernels and with no mask to keep")


def _argument(node: torch.fx.Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _kind(mask: torch.fx.Node, calls: list[torch.fx.Node]) -> str | None:
    """"causal" or "full" where ``mask`` is that at every size checked, else None."""
    nodes, placeholders = _ancestors(mask)
    if nodes is None or not _square(mask, calls):
        return None
    constants = [abs(v) for n in nodes for v in pytree.tree_leaves((n.args, n.kwargs))
                 if type(v) is int and v != sys.maxsize]
    largest = max(constants, default=0)
    if largest > _LARGEST:
        return None
    kinds = set()
    for size in sorted({3, 5, largest + 1, largest + 2}):
        value = _computed(mask, nodes, placeholders, size)
        kinds.add(_which(value, size) if value is not None else None)
    return kinds.pop() if len(kinds) == 1 else None


def _ancestors(mask: torch.fx.Node) -> tuple[set[torch.fx.Node] | None, list[torch.fx.Node]]:
    """The nodes ``mask`` is computed from and the inputs it reads the sizes of; (None, [])
    where it reads a value: of an input, a parameter or a buffer."""
    nodes: set[torch.fx.Node] = set()
    placeholders: list[torch.fx.Node] = []
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in nodes:
            continue
        nodes.add(node)
        if node.op == "call_function" and node.target is aten.sym_size.int:
            source = node.args[0]
            if not (isinstance(source, torch.fx.Node) and source.op == "placeholder"):
                return None, []
            if source not in placeholders:
                placeholders.append(source)
            continue
        if node.op != "call_function":
            return None, []
        stack += node.all_input_nodes
    return nodes, placeholders


def _square(mask: torch.fx.Node, calls: list[torch.fx.Node]) -> bool:
    """Each call's queries and keys are as long as each other (the same size symbol), and so
    are the mask's last two dimensions."""
    lengths = set()
    for value in [mask, *[arg for call in calls for arg in call.args[:2]]]:
        fake = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if not isinstance(fake, torch.Tensor) or fake.dim() < 2:
            return False
        lengths.add(str(fake.shape[-2]))
    fake_mask = mask.meta["val"]
    return len(lengths) == 1 and str(fake_mask.shape[-1]) in lengths


def _computed(mask: torch.fx.Node, nodes: set[torch.fx.Node],
              placeholders: list[torch.fx.Node], size: int) -> torch.Tensor | None:
    """``mask`` computed on the CPU with each input's free dimensions at ``size`` (its
    first at ``_BATCH``); None where an input's shape is unknown or the run fails."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs = []
    for node in placeholders:
        fake = node.meta.get("val")
        if not isinstance(fake, torch.Tensor):
            return None
        shape = [d if isinstance(d, int) else (_BATCH if i == 0 else size)
                 for i, d in enumerate(fake.shape)]
        inputs.append(torch.zeros(shape, dtype=fake.dtype))
        env[node] = graph.placeholder(node.name)
    for node in mask.graph.nodes:  # graph order
        if node in nodes and node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
            env[node].args, env[node].kwargs = pytree.tree_map(_on_cpu, (env[node].args,
                                                                         env[node].kwargs))
    graph.output(env[mask])
    try:
        return torch.fx.GraphModule(torch.nn.Module(), graph)(*inputs)
    except Exception:
        return None


def _on_cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) else value


def _which(value: Any, size: int) -> str | None:
    """"causal" where ``value`` lets query i see keys 0..i only, "full" where every key, for
    every sample and head; a float mask adds 0 where it lets a key be seen and a value
    that no score survives where not."""
    if not isinstance(value, torch.Tensor) or value.shape[-2:] != (size, size):
        return None
    if value.dtype == torch.bool:
        seen = value
    elif value.is_floating_point():
        seen = value == 0
        if not bool((seen | (value <= torch.finfo(value.dtype).min / 2)).all()):
            return None
    else:
        return None
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    if bool((seen == causal).all()):
        return "causal"
    if bool(seen.all()):
        return "full"
    return None
