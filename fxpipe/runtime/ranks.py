"""Which torchrun rank runs which stage.

# K: stages, r_j: replicas of stage j (REPLICAS), Σ r_j processes, v: stages per rank.

Replicated stages (PipeDream's "2-2" or "1-1-2"): stage j runs on r_j ranks,
numbered as ``DEVICE_OF`` numbers its GPUs (stage j's first rank is
r_0 + ... + r_{j-1}), and its replica i takes chunk i of the r_j equal chunks of
every micro-batch. When every stage has the same r, the K·r ranks form r lanes,
each a whole pipeline of K ranks (rank j·r + l runs stage j in lane l)::

    lane 0 | rank 0 (stage 0) ──► rank 2 (stage 1)     chunk 0 of every micro-batch
    lane 1 | rank 1 (stage 0) ──► rank 3 (stage 1)     chunk 1

Interleaved plans (Megatron-LM, v > 1): the K stages run on K / v ranks, stage j
on rank j % (K / v), never replicated::

    rank 0: stage 0, stage 2        stage 0 ──► stage 1 ──► stage 2 ──► stage 3
    rank 1: stage 1, stage 3        (rank 0)    (rank 1)    (rank 0)    (rank 1)
"""

from collections.abc import Sequence

__all__ = ["RankLayout"]


class RankLayout:
    """The ranks of a plan of ``num_stages`` stages with ``replicas`` per stage
    (default 1) and ``virtual_stages`` stages per rank."""

    def __init__(self, num_stages: int, replicas: Sequence[int] = (),
                 virtual_stages: int = 1) -> None:
        self.replicas = tuple(replicas) or (1,) * num_stages
        assert len(self.replicas) == num_stages and min(self.replicas) >= 1
        self.virtual_stages = virtual_stages
        assert num_stages % virtual_stages == 0
        assert virtual_stages == 1 or max(self.replicas) == 1
        # the same r on every stage: r lanes of whole pipelines, else a schedule table
        self.uniform = len(set(self.replicas)) == 1
        self.lanes = self.replicas[0] if self.uniform else 1
        self.first_rank = [sum(self.replicas[:j]) for j in range(num_stages)]

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def num_ranks(self) -> int:
        return sum(self.replicas) // self.virtual_stages

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``: stage j's replicas are ranks first_rank[j] + i
        (with the same r everywhere, rank j·r + l runs stage j in lane l). Interleaved:
        (the rank's first stage, 0)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(
                f"rank {rank} has no stage: this package runs on ranks 0..{self.num_ranks - 1}"
            )
        if self.virtual_stages > 1:
            return rank, 0
        j = max(j for j, first in enumerate(self.first_rank) if first <= rank)
        return j, rank - self.first_rank[j]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs: one, or v when interleaved (rank, rank + K, ...)."""
        first = self.position(rank)[0]
        if self.virtual_stages == 1:
            return (first,)
        return tuple(range(first, self.num_stages, self.num_ranks))

    def ranks_of(self, stage: int) -> tuple[int, ...]:
        """The ranks that run ``stage``: its replicas, or its one rank when interleaved."""
        if self.virtual_stages > 1:
            return (stage % self.num_ranks,)
        return tuple(range(self.first_rank[stage], self.first_rank[stage] + self.replicas[stage]))

    def check_world_size(self, world_size: int) -> None:
        """A job of ``world_size`` processes must have one per rank of this layout."""
        if world_size == self.num_ranks:
            return
        if self.virtual_stages > 1:
            what = (f"GPUs of the plan ({self.num_ranks}, each running "
                    f"{self.virtual_stages} of its {self.num_stages} stages)")
        elif self.num_ranks == self.num_stages:
            what = f"pipeline stages ({self.num_stages})"
        else:
            what = f"GPUs of the plan ({'-'.join(map(str, self.replicas))})"
        raise ValueError(
            f"world size ({world_size}) must equal the number of {what}: launch with "
            f"torchrun --nproc-per-node {self.num_ranks}"
        )
