"""Which torchrun rank runs which stage.

# K: stages, r_j: replicas of stage j (REPLICAS), Σ r_j processes, v: stages per rank.

Replicated stages (PipeDream's "2-2" or "1-1-2"): stage j runs on r_j ranks,
numbered as ``DEVICE_OF`` numbers its GPUs (stage j's first rank is
r_0 + ... + r_{j-1}), and its replica i takes chunk i of the r_j equal chunks of
every micro-batch. When every stage has the same r, the K·r ranks form r lanes,
each a whole pipeline of K ranks (rank j·r + l runs stage j in lane l)::

    lane 0 | rank 0 (stage 0) ──► rank 2 (stage 1)     chunk 0 of every micro-batch
    lane 1 | rank 1 (stage 0) ──► rank 3 (stage 1)     chunk 1

Several stages per rank (v > 1), never replicated: the K stages run on K / v
ranks, stage j on rank ``device_of[j]``: the plan's ``DEVICE_OF``, as the plan
placed them (the runtime does not restate the rule). Interleaved 1F1B (Megatron-LM)
has stage j on rank j % (K / v); ZB-V and DualPipeV have them in a V, stages j and
K - 1 - j on rank j, so the first and last stages (an embedding and its tied head)
share rank 0::

    interleaved | rank 0: stage 0, stage 2    stage 0 ──► stage 1 ──► stage 2 ──► stage 3
                | rank 1: stage 1, stage 3    (rank 0)    (rank 1)    (rank 0)    (rank 1)
    V           | rank 0: stage 0, stage 3    (rank 0)    (rank 1)    (rank 1)    (rank 0)
                | rank 1: stage 1, stage 2

torch's schedule classes assume their own placement (one stage per rank; j % N; the V)
and send each activation to the rank it expects, so a plan runs only under a schedule
kind that places its stages as the plan did (``check_placement``).
"""

from collections.abc import Sequence

from .torch_schedules import placed, torch_schedule
from .torch_zero_bubble import placement

__all__ = ["RankLayout"]


class RankLayout:
    """The ranks of a plan of ``num_stages`` stages with ``replicas`` per stage
    (default 1) and ``virtual_stages`` stages per rank, stage j on rank
    ``device_of[j]`` when there are several."""

    def __init__(self, num_stages: int, replicas: Sequence[int] = (),
                 virtual_stages: int = 1, device_of: Sequence[int] = (), dp: int = 1,
                 tp: int = 1) -> None:
        self.replicas = tuple(replicas) or (1,) * num_stages
        assert len(self.replicas) == num_stages and min(self.replicas) >= 1
        # pipelines side by side (the plan's layout, data_parallel.py): job rank i·pp + j
        # is rank j of pipeline i; every rank below is a pipeline's own
        self.dp = dp
        # each rank split over tp job ranks of a host (tensor_parallel.py): job rank
        # (i·pp + j)·tp + k is rank k of the split of pipeline i's rank j
        self.tp = tp
        assert dp >= 1 and (dp == 1 or max(self.replicas) == 1), (dp, self.replicas)
        self.virtual_stages = virtual_stages
        assert num_stages % virtual_stages == 0
        assert virtual_stages == 1 or max(self.replicas) == 1
        # the same r on every stage: r lanes of whole pipelines, else a schedule table
        self.uniform = len(set(self.replicas)) == 1
        self.lanes = self.replicas[0] if self.uniform else 1
        self.first_rank = [sum(self.replicas[:j]) for j in range(num_stages)]
        # with v > 1: the rank of each stage, v stages on every one of the K / v ranks
        self.rank_of = tuple(device_of)
        assert virtual_stages == 1 or sorted(self.rank_of) == sorted(
            list(range(num_stages // virtual_stages)) * virtual_stages), self.rank_of

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def num_ranks(self) -> int:
        return sum(self.replicas) // self.virtual_stages

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``: stage j's replicas are ranks first_rank[j] + i
        (with the same r everywhere, rank j·r + l runs stage j in lane l). Several
        stages per rank: (the rank's first stage, 0)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(
                f"rank {rank} has no stage: this package runs on ranks 0..{self.num_ranks - 1}"
            )
        if self.virtual_stages > 1:
            return self.rank_of.index(rank), 0
        j = max(j for j, first in enumerate(self.first_rank) if first <= rank)
        return j, rank - self.first_rank[j]

    def one_pipeline(self) -> "RankLayout":
        """One of this layout's whole pipelines (a lane, or a layout's pipeline): its ranks
        numbered from 0, no stage replicated. Assumes uniform replicas."""
        assert self.uniform, self.replicas
        return RankLayout(self.num_stages, (), self.virtual_stages, self.rank_of)

    def copy_of(self, rank: int) -> int:
        """Which copy of its stage job rank ``rank`` runs: its pipeline (a layout), its
        lane, or its replica; copy 0 speaks for them all."""
        if self.dp * self.tp > 1:
            return rank // (self.num_ranks * self.tp)
        return self.position(rank)[1]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs: one, or v in stage order."""
        first = self.position(rank)[0]
        if self.virtual_stages == 1:
            return (first,)
        return tuple(j for j, r in enumerate(self.rank_of) if r == rank)

    def ranks_of(self, stage: int) -> tuple[int, ...]:
        """The ranks that run ``stage``: its replicas, or its one rank when v > 1."""
        if self.virtual_stages > 1:
            return (self.rank_of[stage],)
        return tuple(range(self.first_rank[stage], self.first_rank[stage] + self.replicas[stage]))

    def lane_ranks(self) -> tuple[int, ...]:
        """Each stage's rank within its lane's pipeline (torch's group rank)."""
        return self.rank_of if self.virtual_stages > 1 else tuple(range(self.num_stages))

    def check_stage(self, k: int) -> int:
        """``k``, refused in one line where this plan has no stage ``k``."""
        if not 0 <= k < self.num_stages:
            raise ValueError(f"no stage {k}: this package has stages 0..{self.num_stages - 1}")
        return k

    def check_world_size(self, world_size: int) -> None:
        """A job of ``world_size`` processes must have one per rank of this layout."""
        if world_size == self.num_ranks * self.dp * self.tp:
            return
        if self.tp > 1:
            what = (f"GPUs of the plan's layout ({self.dp} pipeline{'s' * (self.dp > 1)} of "
                    f"{self.num_ranks} ranks, each rank's stages split over {self.tp} GPUs, "
                    f"{self.dp * self.num_ranks * self.tp} in all)")
        elif self.dp > 1:
            what = (f"GPUs of the plan's layout ({self.dp} data-parallel pipelines of "
                    f"{self.num_ranks} GPUs, {self.dp * self.num_ranks} in all)")
        elif self.virtual_stages > 1:
            what = (f"GPUs of the plan ({self.num_ranks}, each running "
                    f"{self.virtual_stages} of its {self.num_stages} stages)")
        elif self.num_ranks == self.num_stages:
            what = f"pipeline stages ({self.num_stages})"
        else:
            what = f"GPUs of the plan ({'-'.join(map(str, self.replicas))})"
        raise ValueError(
            f"world size ({world_size}) must equal the number of {what}: launch with "
            f"torchrun --nproc-per-node {self.num_ranks * self.dp * self.tp}"
        )

    def check_placement(self, kind: str, planned: str) -> None:
        """Refuse to run this plan, split for ``planned``, under schedule ``kind`` when
        torch's class for ``kind`` puts the stages on other ranks than the plan did."""
        have = self.lane_ranks()
        k, n = len(have), len(set(have))
        if placed(kind, k, n) == have:
            return
        how = torch_schedule(kind)
        if how.splits_backward:
            runs = placement(kind, k, n)
        elif how.placement == "loop":
            runs = (f"{kind} runs several stages per rank, stage j on rank j % {n} "
                    f"({k} stages on {n} ranks)")
        else:
            runs = f"{kind} runs one stage per rank ({k} stages on {n} ranks)"
        raise ValueError(f"this plan was split for {planned}, stage j on rank {list(have)}[j]; "
                         f"{runs}: split again with --schedule {kind}")
