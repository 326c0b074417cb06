"""Attention calls as the model makes them eagerly, where ``torch.export`` records them
otherwise.

Eagerly, transformers calls ``scaled_dot_product_attention`` with ``is_causal=True`` and no
mask when nothing is padded, and hands grouped-query heads over as they are
(``enable_gqa=True``). Under export it does neither (it will not let a traced graph rely
on either): every call gets a (batch, 1, seq, seq) causal mask, and the keys and values
repeated to the query heads. A GPU then runs the memory-efficient kernel, which keeps an
L x L copy of the mask per call for backward, every stage after the first receives the
mask, and the gradients of the repeated keys and values are summed in the activations'
precision rather than inside the kernel. The stages would train slower and hold more
than the model does (the plan would say so), and differ from it in bfloat16.

- **Masks** (``causal``): each mask that depends on the input sizes only (no value of any
  input, parameter or buffer) is computed at several sizes on the CPU; where it lets
  each query see exactly the keys up to its own position at every one of them, the calls
  that read it take ``is_causal=True`` and no mask; where it lets every query see every
  key, no mask. The sizes checked exceed every integer constant of the mask's
  computation, so a sliding window, an offset or a prefix shows as a mask that is not
  causal, and the mask is kept. A mask of query and key lengths that may differ is kept.
- **Grouped heads** (``grouped``): in a call whose mask was given back (the call
  transformers makes eagerly without a mask, and so with ``enable_gqa``), keys and values
  repeated to the query heads as transformers' ``repeat_kv`` does (``x[:, :,
  None].expand(b, h, n, s, d).reshape(b, h * n, s, d)``, each head n times in a row, which
  is how ``enable_gqa`` pairs query heads with key heads) are handed over unrepeated with
  ``enable_gqa=True``, where the head dims are equal and at most 256 and the queries in
  half precision: what FlashAttention takes. In float32 a GPU has no fused kernel for
  grouped heads (transformers' eager call runs the math kernel there), so the repeat
  stays.

- **Layouts** (``_layouts``): which memory layout an attention call's output has is the
  kernel's choice: the flash kernels (the CPU's too) give (batch, seq, heads, dim) in
  memory, the math kernel (float64, or float32 with grouped heads, on a GPU) the
  logical order. transformers 4.x writes ``out.transpose(1, 2).contiguous().view(...)``,
  and export, tracing on the CPU's flash kernel, dropped the ``contiguous`` (a no-op
  there), so the ``view`` failed wherever the math kernel ran. Views of an attention
  output, through transposes and permutes, are reshapes: the same view where it holds, a
  copy where it would fail.

Each call rewritten says so in its ``meta.ATTENTION`` record; ``describe`` words the note.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fxpipe import meta

__all__ = ["attention_calls", "describe"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_LARGEST = 512  # constants above this in a mask's computation: not checked, kept
_BATCH = 2  # the batch size the masks are computed at
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def attention_calls(gm: torch.fx.GraphModule, autocast: torch.dtype | None) -> None:
    """Rewrite the attention calls of ``gm``, a graph ``torch.export`` made of a model that
    trains under ``autocast`` (a dtype, or None), as the module docstring says."""
    _causal(gm)
    _grouped(gm, autocast)
    _layouts(gm)
    gm.recompile()


def _causal(gm: torch.fx.GraphModule) -> None:
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _SDPA:
            mask = _argument(node, 3, "attn_mask")
            if isinstance(mask, torch.fx.Node) and not _argument(node, 5, "is_causal"):
                readers.setdefault(mask, []).append(node)
    computed: set[torch.fx.Node] = set()
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
            _changed(call, kind)
        computed |= _ancestors(mask)[0] or set()
    _erase_unread(gm, computed)


def _changed(call: torch.fx.Node, kind: str) -> None:
    meta.ATTENTION.set(call, (*meta.ATTENTION.get(call), kind) if meta.ATTENTION.has(call)
                       else (kind,))


def _erase_unread(gm: torch.fx.GraphModule, nodes: set[torch.fx.Node]) -> None:
    """Erase those of ``nodes`` nothing reads any more (last first)."""
    for node in reversed(gm.graph.nodes):
        if node in nodes and not node.users and node.op != "placeholder":
            gm.graph.erase_node(node)


def _grouped(gm: torch.fx.GraphModule, autocast: torch.dtype | None) -> None:
    repeating: set[torch.fx.Node] = set()  # the repeats of the calls rewritten
    for call in gm.graph.nodes:
        if not (call.op == "call_function" and call.target is _SDPA):
            continue
        if not meta.ATTENTION.has(call) or call.kwargs.get("enable_gqa"):
            continue  # (a mask given back: the call transformers makes without one)
        query, key, value = call.args[:3]
        repeats = [_repeated(key), _repeated(value)]
        if not all(repeats) or len({r[1] for r in repeats if r}) != 1:
            continue
        q = query.meta.get("val") if isinstance(query, torch.fx.Node) else None
        heads = {t.meta["val"].shape[-1] for t in (key, value)}
        half = (torch.float16, torch.bfloat16)
        if not (isinstance(q, torch.Tensor) and (q.dtype in half or autocast in half)
                and heads == {q.shape[-1]}
                and isinstance(q.shape[-1], int) and q.shape[-1] <= 256):
            continue
        call.args = (query, repeats[0][0], repeats[1][0], *call.args[3:])  # type: ignore[index]
        call.kwargs = {**call.kwargs, "enable_gqa": True}
        _changed(call, "grouped")
        repeating |= {key, value, *key.all_input_nodes, *value.all_input_nodes,
                      *[n for t in (key, value) for a in t.all_input_nodes
                        for n in a.all_input_nodes]}
    _erase_unread(gm, repeating)


def _layouts(gm: torch.fx.GraphModule) -> None:
    """Make reshapes of the views of each attention output (see the module docstring)."""
    reordering = (aten.transpose.int, aten.permute.default)
    for call in gm.graph.nodes:
        if not (call.op == "call_function" and call.target is _SDPA):
            continue
        reached = list(call.users)
        while reached:
            node = reached.pop()
            if node.target in reordering:
                reached.extend(node.users)
            elif node.target is aten.view.default:
                node.target = aten.reshape.default


def _repeated(node: Any) -> tuple[torch.fx.Node, int] | None:
    """(x, n) where ``node`` is ``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s,
    d)`` of a 4-d ``x`` with ``n`` > 1 (each head n times in a row), else None."""
    expand = _input_of(node, _RESHAPES)
    unsqueeze = _input_of(expand, (aten.expand.default,))
    source = _input_of(unsqueeze, (aten.unsqueeze.default,))
    if source is None or unsqueeze.args[1] != 2:
        return None
    shapes = [_shape(n) for n in (source, expand, node)]
    if not all(shapes) or len(shapes[0]) != 4:
        return None
    (b, h, s, d), (eb, eh, n, es, ed), (rb, rh, rs, rd) = shapes
    if not ((eb, eh, es, ed) == (b, h, s, d) and (rb, rs, rd) == (b, s, d) and n.isdigit()
            and int(n) > 1 and h.isdigit() and rh == str(int(h) * int(n))):
        return None
    return source, int(n)


def _input_of(node: Any, targets: tuple[Any, ...]) -> Any:
    """``node``'s first argument, a node, where ``node`` calls one of ``targets``."""
    if isinstance(node, torch.fx.Node) and node.target in targets and \
            isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return None


def _shape(node: torch.fx.Node) -> tuple[str, ...]:
    """The traced shape of ``node``'s value, each size as text (a symbol's name)."""
    value = node.meta.get("val")
    return tuple(str(d) for d in value.shape) if isinstance(value, torch.Tensor) else ()


def describe(gm: torch.fx.GraphModule) -> str | None:
    """The note for the attention calls ``attention_calls`` rewrote in ``gm``, if any."""
    done = [kind for n in gm.graph.nodes if meta.ATTENTION.has(n)
            for kind in meta.ATTENTION.get(n)]
    if not done:
        return None
    said = {"causal": "a causal mask built from the input sizes alone now is_causal=True",
            "full": "a mask built from the input sizes that hides nothing dropped",
            "grouped": "keys and values repeated to the query heads now enable_gqa=True"}
    parts = [f"{done.count(kind)} with {text}" for kind, text in said.items()
             if kind in done]
    return (f"attention as transformers calls it eagerly, where torch.export recorded it "
            f"otherwise: {'; '.join(parts)} (the same attention, on the fused kernels; "
            f"masks checked at several sizes)")


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
