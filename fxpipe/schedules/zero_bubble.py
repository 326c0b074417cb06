"""The zero-bubble schedules' tables: ZB-H1, ZB-V and DualPipeV.

A zero-bubble table runs each backward as two actions: I, the input gradient, which
the previous stage waits for, and W, the weight gradient, which nothing waits for and
which fills the bubbles (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24). Each
action is one tick, so a table is drawn, simulated and checked with unit costs
F = I = W; the per-GPU orders are torch.distributed.pipelining's (torch 2.13), so the
single-process runner and torchrun run the same schedule.
"""

from __future__ import annotations

from fxpipe.schedules.ticks import Action, Table, check_sizes, to_ticks

__all__ = ["dualpipev", "v_devices", "zb1p", "zbv"]

# K: number of GPUs (of stages for zb1p), M: number of micro-batches, d: a GPU,
# s0, s1: a GPU's two stages in a V (chunks 0 and 1), m: a micro-batch.


def zb1p(num_stages: int, microbatches: int) -> Table:
    """ZB-H1 (torch's ``ScheduleInterleavedZeroBubble`` with one stage per GPU): 1F1B's
    order and activation memory (stage j holds min(M, K - j) micro-batches), the
    backward split into I and W, stage j holding its first j weight gradients back for
    the drain (so it keeps up to j + 1 micro-batches' ``deferred_bytes``). With
    F = I = W = one tick and M >= K each GPU idles K - 1 ticks of 3M + K - 1: the
    paper's (K - 1)(T_F + T_B - T_W), against 1F1B's (K - 1)(T_F + T_B + T_W).
    K = 3, M = 4::

        stage 0 | F0 F1 F2 .. .. I0 W0 F3 I1 W1 I2 W2 I3 W3
        stage 1 | .. F0 F1 .. I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
        stage 2 | .. .. F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3
    """
    check_sizes(num_stages, microbatches)
    K, M = num_stages, microbatches
    orders: list[list[Action]] = []
    for j in range(K):
        warmup = min(K - 1 - j, M)  # forwards before the first backward
        order: list[Action] = [(j, "F", m) for m in range(warmup)]
        weights = 0  # W actions issued so far
        for i in range(M):  # the i-th input gradient, after the next forward if any
            if warmup + i < M:
                order.append((j, "F", warmup + i))
            order.append((j, "I", i))
            if i >= j:  # stage j lets j weight gradients wait for the drain
                order.append((j, "W", weights))
                weights += 1
        order += [(j, "W", m) for m in range(weights, M)]
        orders.append(order)
    return to_ticks(orders, K)


def v_devices(num_devices: int) -> tuple[int, ...]:
    """The GPU of each of the 2K virtual stages in a V placement: stage j and stage
    2K - 1 - j on GPU j, so the model goes down the GPUs and back up, and the first and
    last stages (an embedding and its tied LM head) share GPU 0."""
    K = num_devices
    return tuple(j if j < K else 2 * K - 1 - j for j in range(2 * K))


def _check_v(num_devices: int, microbatches: int) -> None:
    if num_devices < 1:
        raise ValueError(f"number of GPUs ({num_devices}) must be at least 1")
    check_sizes(2 * num_devices, microbatches)


def zbv(num_devices: int, microbatches: int) -> Table:
    """ZB-V (torch's ``ScheduleZBVZeroBubble``; the Zero Bubble paper, section 6): two
    V-placed chunks per GPU (``v_devices``), chunk 0 (stage d) and chunk 1 (stage
    2K - 1 - d) on GPU d, the backward split into I and W. A tick is one chunk's
    action, half a stage's of ZB-H1 on the same GPUs. With F = I = W and M >= 2K each
    GPU idles K - 1 ticks of 6M + K - 1, the fewest any table can (the last GPU starts
    at tick K - 1 and every GPU has 6M actions): ZB-H1's (K - 1)(T_F + T_B - T_W) in
    chunk times, half its bubble in time. Virtual stage s holds 2K - s micro-batches at
    its peak, so GPU d holds 2K + 1 chunks' activations, about 1F1B's first stage.
    K = 2, M = 2 (``a``: chunk 0, ``b``: chunk 1)::

        gpu 0 | F0a F1a ... F0b I0b W0b F1b I1b W1b I0a W0a ... I1a W1a
        gpu 1 | ... F0a F0b F1a F1b I0b W0b I0a W0a I1b W1b I1a W1a ...
    """
    _check_v(num_devices, microbatches)
    K, M = num_devices, microbatches
    n = max(2 * K - 1, M)  # torch fills the pipeline with at least 2K - 1, then drops them
    orders: list[list[Action]] = []
    for d in range(K):
        s0, s1 = d, 2 * K - 1 - d
        count = {(s, kind): 0 for s in (s0, s1) for kind in ("F", "I", "W")}
        order: list[Action] = []

        def add(stage: int, kind: str, order: list[Action] = order,
                count: dict[tuple[int, str], int] = count) -> None:
            m = count[stage, kind]
            count[stage, kind] += 1
            if m < M:
                order.append((stage, kind, m))

        for _ in range(2 * (K - d) - 1):  # warm-up: chunk 0 forwards
            add(s0, "F")
        for _ in range(d):
            add(s1, "F")
            add(s0, "F")
        for _ in range(K - d):  # chunk 1's first backwards, W at once
            add(s1, "F")
            add(s1, "I")
            add(s1, "W")
        while count[s1, "F"] < count[s0, "F"] or count[s0, "F"] < n:  # steady state
            if count[s0, "F"] < n:
                add(s0, "F")
            add(s0, "I")
            add(s0, "W")
            add(s1, "F")
            add(s1, "I")
            add(s1, "W")
        for _ in range(d):  # cool-down: input gradients first, weights after
            add(s0, "I")
            add(s1, "I")
        for _ in range(K - d):
            add(s0, "I")
            add(s0, "W")
        while count[s1, "W"] < count[s1, "I"]:
            add(s1, "W")
        while count[s0, "W"] < count[s0, "I"]:
            add(s0, "W")
        orders.append(order)
    return to_ticks(orders, 2 * K)


def dualpipev(num_devices: int, microbatches: int) -> Table:
    """DualPipeV (DeepSeek-V3's DualPipe cut to a V, torch's ``ScheduleDualPipeV``): the
    V placement of ``zbv``, chunk 0's forward paired with chunk 1's backward and the
    reverse in the steady state, so that on a GPU one micro-batch's communication hides
    behind another's computation. Its overlapped forward-backward pairs and full
    backwards are written as their parts, in the order they run (F then I then W; a full
    backward is I then W at once), so the table has unit actions like the others.
    Needs M >= 2K. With F = I = W each GPU idles K - 1 ticks of 6M + K - 1, as ZB-V:
    its gain over ZB-V is the communication it hides, which a table of unit actions
    does not show. (DeepSeek's (PP/2 - 1)(F&B + B - 3W) counts an overlapped pair as one
    action of F + B; run as its parts, the packing fills K - 1 more of those ticks.)
    K = 2, M = 4::

        gpu 0 | F0a F1a F2a F0b I0b W0b F1b F3a I1b W1b F2b I0a W0a I2b W2b F3b I1a W1a ...
        gpu 1 | ... F0a F0b F1a F1b F2a I0b W0b F2b I0a W0a F3a I1b W1b F3b I1a W1a I2b ...
    """
    _check_v(num_devices, microbatches)
    K, M = num_devices, microbatches
    if M < 2 * K:
        raise ValueError(
            f"DualPipeV needs at least as many micro-batches ({M}) as stages ({2 * K}): "
            f"use --microbatches {2 * K}")
    orders: list[list[Action]] = []
    for d in range(K):
        s0, s1 = d, 2 * K - 1 - d
        count = {(s, kind): 0 for s in (s0, s1) for kind in ("F", "I", "W")}
        pending: list[tuple[int, int]] = []  # (stage, micro-batch) whose W waits
        order: list[Action] = []

        def add(stage: int, kind: str, order: list[Action] = order,
                count: dict[tuple[int, str], int] = count,
                pending: list[tuple[int, int]] = pending) -> None:
            """F, I (its W queued), or "B": a full backward, written I then W."""
            key = "I" if kind == "B" else kind
            m = count[stage, key]
            count[stage, key] += 1
            order.append((stage, key, m))
            if kind == "B":
                order.append((stage, "W", m))
                count[stage, "W"] += 1
            elif kind == "I":
                pending.append((stage, m))

        def add_weight(order: list[Action] = order, count: dict[tuple[int, str], int] = count,
                       pending: list[tuple[int, int]] = pending) -> None:
            if pending:
                stage, m = pending.pop(0)
                order.append((stage, "W", m))
                count[stage, "W"] += 1

        for _ in range((K - d - 1) * 2):  # 1: chunk 0 forwards
            add(s0, "F")
        for _ in range(d + 1):  # 2: both chunks' forwards
            add(s0, "F")
            add(s1, "F")
        for _ in range(K - d - 1):  # 3: chunk 1 backward, zero-bubble style
            add(s1, "I")
            add_weight()
            add(s1, "F")
        for _ in range(M - 2 * K + d + 1):  # 4: F0 with B1, F1 with B0
            add(s0, "F")
            add(s1, "B")
            add(s1, "F")
            add(s0, "B")
        for _ in range(K - d - 1):  # 5: B1, then F1 with B0
            add(s1, "B")
            add(s1, "F")
            add(s0, "B")
        zero_bubble = False
        for i in range(d + 1):  # 6: both chunks' backwards, the second half split
            if i == (d + 1) // 2 and d % 2 == 1:
                zero_bubble = True
            add(s1, "I" if zero_bubble else "B")
            if i == (d + 1) // 2 and d % 2 == 0:
                zero_bubble = True
            add(s0, "I" if zero_bubble else "B")
        for _ in range(K - d - 1):  # 7: pending weights, chunk 0 backwards
            add_weight()
            add(s0, "I" if zero_bubble else "B")
        for _ in range(d + 1):  # 8: the last pending weights
            add_weight()
        while pending:
            add_weight()
        orders.append(order)
    return to_ticks(orders, 2 * K)
