"""The zero-bubble schedules under torchrun, on torch.distributed.pipelining's own classes.

# K: stages, N: ranks, M: micro-batches.

    zb1p      -> ScheduleInterleavedZeroBubble    one stage per rank (ZB-H1)
    zbv       -> ScheduleZBVZeroBubble            two stages per rank, in a V
    dualpipev -> ScheduleDualPipeV                two stages per rank, in a V, M >= K

torch runs each backward as two actions: I, the gradient of the stage's inputs
(``stage_backward_input``), which the previous stage waits for, and W, the gradient
of its weights, later, in a bubble. Three things differ from the other schedules:

1. After I, torch detaches the stage's outputs in place (``detach_``, to free the
   graph before W runs). That fails on an output that is a view ("Can't detach views
   in-place") and breaks W when the stage saved that same tensor for its own weight
   gradient ("a saved tensor that has been detached in-place"). So under these
   schedules every ``StageAdapter`` sends clones of its outputs (``split_backward``).
   Every send, not only those that need it: knowing which outputs autograd saved takes a
   hook on every tensor each op saves, on every micro-batch, while a clone is one copy
   of the bytes that cross to the next rank anyway (the clone's backward is the
   identity and saves nothing; the original is freed unless the stage saved it).
   torch also sends the input gradients as ``autograd.grad`` returns them, which may
   not be contiguous (the backward of a ``cat`` is slices of one gradient), and gloo
   and NCCL send contiguous memory only: the adapter makes them contiguous with a hook.
2. ZB-V and DualPipeV place the stages in a V, rank r running stages r and K - 1 - r,
   which also puts an embedding and its tied LM head on rank 0 (one copy, no
   all-reduce). torch computes that placement itself; the plan's (``DEVICE_OF``, read
   by ``RankLayout``) must be the same, which ``zero_bubble_schedule`` checks.
3. torch finds, in I, the part of the graph W needs: the nodes where a path from a
   parameter meets a path from a received tensor (``stage_backward_input``). A parameter
   whose path reaches the stage's output without meeting one (an embedding of token ids
   that are all the stage receives, as when the stages before it hold no parameters) gets
   no gradient from W, without a word. ``zero_bubble_schedule`` has each adapter look at
   its first micro-batch's graph (``beyond_received``); a stage with such an output runs
   its whole backward at I (torch's ``dw_builder``), its W left empty.
4. torch's ``scale_grads`` divides each stage's gradients by M at that stage's last
   backward: a parameter two stages of one rank share (the tied weight in a V) would
   be divided twice. The schedules are built with ``scale_grads=False`` and
   ``DistributedPipeline.train_step`` divides every parameter's gradient once.

DualPipeV runs a paired forward and backward one after the other: torch accepts an
overlapped forward-backward function (``OVERLAP_F_B``), which fxpipe does not
generate.
"""

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree

from .adapter import StageAdapter, torch_schedule_kwargs
from .recompute import refuse_split_backward
from .torch_schedules import TORCH_SCHEDULES, schedule_class

__all__ = ["ZERO_BUBBLE", "beyond_received", "placement", "requirement",
           "zero_bubble_schedule"]

# the schedule kinds that split the backward -> their torch.distributed.pipelining class
# (by name: importing this module, as codegen does, does not import torch's pipelining)
ZERO_BUBBLE = {kind: how.class_name for kind, how in TORCH_SCHEDULES.items()
               if how.splits_backward}


def placement(kind: str, num_stages: int, num_ranks: int) -> str:
    """Where torch's class for ``kind`` runs the stages, as the start of a sentence."""
    k, n, name = num_stages, num_ranks, ZERO_BUBBLE[kind]
    if kind == "zb1p":
        return f"zb1p runs on torch's {name} with one stage per rank ({k} stages on {n} ranks)"
    return (f"{kind} runs on torch's {name} with exactly 2 stages per rank in a V, rank r "
            f"running stages r and {k - 1} - r ({k} stages on {n} ranks)")


def requirement(kind: str, num_stages: int, num_ranks: int, microbatches: int,
                ) -> tuple[str, bool]:
    """What torch's class for ``kind`` needs, as one sentence with this plan's numbers,
    and whether the plan meets it."""
    k, n, m = num_stages, num_ranks, microbatches
    text = placement(kind, k, n)
    if kind == "zb1p":
        rounds = max(1, m // n)
        return (f"{text} and M = {m} micro-batches in max(1, M // {n}) = {rounds} equal "
                f"rounds", k == n and m % rounds == 0)
    if kind == "dualpipev":
        return (f"{text}, and at least as many micro-batches as stages (M = {m})",
                k == 2 * n and m >= k)
    return text, k == 2 * n


def zero_bubble_schedule(
    kind: str,
    stages: Sequence[Any],
    rank_of: Sequence[int],
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    shared: Collection[str] = (),
) -> Any:
    """torch's schedule for ``kind`` over this rank's ``PipelineStage``s (``rank_of[j]``:
    the pipeline rank of stage j, as the plan placed it), gradients left unscaled: the
    caller divides them by M once per parameter; the ``shared`` graph inputs whole in
    every micro-batch. ``requirement`` is checked before any stage is touched."""
    k, n, m = len(rank_of), len(set(rank_of)), microbatches
    sentence, met = requirement(kind, k, n, m)
    if not met:
        if kind == "zb1p" and k == n:
            fix = f"split again with --microbatches {-(-m // n) * n} (a multiple of {n})"
        elif kind == "dualpipev" and k == 2 * n:
            fix = f"split again with --microbatches {k}"
        else:
            fix = f"split again with --schedule {kind}"
        raise ValueError(f"{sentence}: {fix} (runner.PipelineRunner runs this plan as it is, "
                         f"in one process)")
    adapters = [cast(StageAdapter, stage.submod) for stage in stages]
    refuse_split_backward((adapter.recompute for adapter in adapters), kind,
                          "split again with --recompute full or none, or another --schedule")
    for stage, adapter in zip(stages, adapters, strict=True):
        adapter.microbatches = m
        adapter.split_backward = True  # clone sends, contiguous input gradients (point 1)
        if not stage.is_first:  # torch runs the first stage's whole backward at W already
            adapter.check_graph = functools.partial(_whole_backward_if_beyond, stage)
    schedule = schedule_class(kind)(list(stages), n_microbatches=m, scale_grads=False,
                              **torch_schedule_kwargs(stages, loss_fn, shared))
    torch_ranks = [schedule.stage_index_to_group_rank[j] for j in range(k)]
    if torch_ranks != list(rank_of):
        raise ValueError(
            f"torch's {type(schedule).__name__} runs the stages on ranks {torch_ranks}, but "
            f"this plan placed them on ranks {list(rank_of)}: split again with --schedule "
            f"{kind}")
    return schedule


def beyond_received(received: Sequence[torch.Tensor], outputs: Any) -> bool:
    """Whether an output of a stage that needs a gradient depends on no ``received``
    tensor that needs one, only on parameters: torch's split backward would give those
    parameters no gradient (point 3). Walks the autograd graph of one micro-batch."""
    sources = {id(x) for x in received if isinstance(x, torch.Tensor) and x.requires_grad}
    reaches: dict[Any, bool] = {}  # autograd node -> whether a received tensor is behind it

    def behind(root: Any) -> bool:
        stack = [root]
        while stack:  # post-order without recursion: a stage's graph may be deep
            node = stack[-1]
            children = [c for c, _ in node.next_functions if c is not None and c not in reaches]
            if children:
                stack.extend(children)
                continue
            stack.pop()
            variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf tensor
            reaches[node] = (variable is not None and id(variable) in sources) or any(
                reaches[c] for c, _ in node.next_functions if c is not None)
        return reaches[root]

    return any(not behind(x.grad_fn) for x in pytree.tree_leaves(outputs)
               if isinstance(x, torch.Tensor) and x.grad_fn is not None)


def _whole_backward_if_beyond(stage: Any, received: Sequence[torch.Tensor],
                              outputs: Any) -> None:
    """``StageAdapter.check_graph`` under a split backward: where torch's W would miss a
    parameter's gradient, run the stage's whole backward at I and nothing at W (torch
    calls a ``dw_builder``'s runner at W instead of its own weight gradient)."""
    if beyond_received(received, outputs):
        stage.dw_builder = _nothing_at_w


def _nothing_at_w() -> Callable[[], None]:
    return lambda: None
