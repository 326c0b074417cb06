"""The tables of the schedules that flush at the end of every step: GPipe, 1F1B and
Megatron-LM's interleaved 1F1B.

GPipe (fill-drain, Huang et al. 2019): every forward, then every backward.
K = 3, M = 4::

    stage 0 | F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3
    stage 1 | .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 ..
    stage 2 | .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. ..
    (``..`` is an idle stage: the bubble; every stage holds M activations)

1F1B with flush (PipeDream-flush, Megatron-LM): stage j runs min(K - j, M)
warm-up forwards, then alternates one backward and one forward, then drains
its remaining backwards. At most min(M, K - j) micro-batches are in flight
on stage j instead of M. K = 3, M = 4::

    stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..

Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM's
``forward_backward_pipelining_with_interleaving``): the model is cut into K * v
stages and GPU d runs the v "model chunks" d, K + d, 2K + d, ... (virtual stage
c * K + d is chunk c of GPU d). Each GPU runs forwards in groups of K
micro-batches, chunk after chunk, and backwards through the chunks in reverse:
min(v * M, 2 (K - d - 1) + (v - 1) K) warm-up forwards on GPU d, then one
forward and one backward at a time, then the remaining backwards. M must be a
multiple of K. The bubble shrinks v-fold, to (K - 1) / (v * M + K - 1) of the
step. Drawn one row per GPU, a cell is the kind, the micro-batch and the chunk
as a letter (``F1b``: forward of micro-batch 1 on chunk b, virtual stage K + d).
K = 2, v = 2, M = 4::

    gpu 0 | F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a ... B2b ... B3b B2a B3a
    gpu 1 | ... F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a ...
    (GPU 0 runs virtual stages 0 (a) and 2 (b), GPU 1 stages 1 (a) and 3 (b); 2
    idle ticks of 18 per GPU: (K - 1) / (v * M + K - 1) = 1/9. At their peaks
    virtual stages 0, 1, 2, 3 hold 4, 3, 2, 1 micro-batches' activations)

A GPU runs one action at a time, so a tick holds at most one action per GPU.
"""

from __future__ import annotations

from fxpipe.schedules.ticks import Action, Table, check_sizes, to_ticks

__all__ = ["gpipe", "interleaved_1f1b", "interleaved_devices", "one_f_one_b"]

# K: number of stages (of GPUs when interleaved), M: number of micro-batches,
# v: virtual stages (model chunks) per GPU, j: a stage, d: a GPU, c: a chunk,
# m: a micro-batch.


def gpipe(num_stages: int, microbatches: int) -> Table:
    """Fill-drain: all forwards of all micro-batches, then all backwards."""
    check_sizes(num_stages, microbatches)
    all_mb = range(microbatches)
    orders = [
        [(j, "F", m) for m in all_mb] + [(j, "B", m) for m in all_mb]
        for j in range(num_stages)
    ]
    return to_ticks(orders, num_stages)


def one_f_one_b(num_stages: int, microbatches: int) -> Table:
    """1F1B with a flush at the end of the step (PipeDream-flush / Megatron-LM)."""
    check_sizes(num_stages, microbatches)
    orders: list[list[Action]] = []
    for j in range(num_stages):
        warmup = min(num_stages - j, microbatches)  # forwards before the first backward
        order: list[Action] = [(j, "F", m) for m in range(warmup)]
        for m in range(microbatches - warmup):  # steady state: B(m), F(m + warmup)
            order += [(j, "B", m), (j, "F", m + warmup)]
        order += [(j, "B", m) for m in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return to_ticks(orders, num_stages)


def interleaved_devices(num_devices: int, virtual_stages: int) -> tuple[int, ...]:
    """The GPU of each of the K * v virtual stages: round robin, stage j on GPU j % K."""
    return tuple(j % num_devices for j in range(num_devices * virtual_stages))


def interleaved_1f1b(num_devices: int, virtual_stages: int, microbatches: int) -> Table:
    """Megatron-LM's interleaved 1F1B over K GPUs with v model chunks each; actions name
    the virtual stage c * K + d (see ``interleaved_devices``). With v = 1 it is
    ``one_f_one_b`` (Megatron then runs its schedule without interleaving)."""
    K, v, M = num_devices, virtual_stages, microbatches
    if K < 1:
        raise ValueError(f"number of GPUs ({K}) must be at least 1")
    if v < 1:
        raise ValueError(
            f"number of virtual stages per GPU ({v}) must be at least 1 (1: plain 1F1B)"
        )
    check_sizes(K * v, M)
    if v > 1 and M % K:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batches ({M}) to be a multiple of the GPUs "
            f"({K}): use --microbatches {-(-M // K) * K}"
        )
    total = M * v  # actions of each kind per GPU

    def forward(d: int, i: int) -> Action:
        # forward number i: groups of K micro-batches, chunk after chunk
        c = (i // K) % v
        return (c * K + d, "F", (i // (K * v)) * K + i % K)

    def backward(d: int, i: int) -> Action:
        # backward number i: the same micro-batch groups, the chunks in reverse
        c = v - 1 - (i // K) % v
        return (c * K + d, "B", (i // (K * v)) * K + i % K)

    orders: list[list[Action]] = []
    for d in range(K):
        # Warm-up forwards on GPU d. Without interleaving Megatron runs K - d - 1 (its
        # steady state starts with a forward). With it, Megatron-core runs two per GPU
        # after d (the forwards that fit while micro-batch 0 goes down to the last GPU
        # and its gradient comes back, a tick per GPU each way) plus a group of K for
        # every chunk but the last. (Megatron-LM before core ran every forward first
        # when M == K; core does not.)
        warmup = K - d - 1 if v == 1 else (K - d - 1) * 2 + (v - 1) * K
        warmup = min(warmup, total)
        order = [forward(d, i) for i in range(warmup)]
        for i in range(total - warmup):  # steady state: one forward, one backward
            order += [forward(d, warmup + i), backward(d, i)]
        order += [backward(d, i) for i in range(total - warmup, total)]
        orders.append(order)
    return to_ticks(orders, K * v)
