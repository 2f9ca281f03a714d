"""Rank layout of a fleet: Megatron rank order, frontend ranks, pods per shard and refit membership.

The reconcile flow calls these pure functions after :mod:`megafleet.planner.validation` has
accepted a spec: they decide how many pods a shard needs, which
ranks host an OpenAI frontend, whether a shard must sit in one NVLink clique, and which global
ranks each live shard takes in the trainer+fleet refit communicator. Nothing here talks to
Kubernetes.

Rank order follows Megatron and NeMo RL's ``Policy``: ``arange(world).reshape(PP, DP, CP, TP)``,
so TP is fastest, then CP, then DP, and PP is slowest. Each shard of a fleet is its own engine
world, so inside a shard the data-parallel size is 1.

The functions raise :class:`ValueError` on input that validation would have rejected; they never
return a half-valid layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = [
    "Membership",
    "Parallelism",
    "PodLayout",
    "RankCoord",
    "frontend_ranks",
    "needs_clique",
    "pod_layout",
    "rank_coordinates",
    "rank_offsets",
]


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Model-parallel sizes of one shard (``spec.parallelism``).

    Attributes:
        tensor: tensor-parallel size (TP).
        pipeline: pipeline-parallel size (PP).
        context: context-parallel size (CP); the megatron backend needs 1.
        expert: expert-parallel size (EP) of MoE layers.
        expert_tensor: tensor-parallel size inside each expert (ETP).
    """

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int = 1

    @property
    def shard_size(self) -> int:
        """Ranks (and GPUs, on a GPU fleet) of one shard: ``tensor * pipeline * context``."""
        return self.tensor * self.pipeline * self.context

    @property
    def nvlink_span(self) -> int:
        """Largest GPU group that needs full NVLink connectivity: ``max(TP * CP, ETP * EP)``."""
        return max(self.tensor * self.context, self.expert_tensor * self.expert)


@dataclasses.dataclass(frozen=True)
class RankCoord:
    """Where one global rank sits in the ``(PP, DP, CP, TP)`` grid."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int


@dataclasses.dataclass(frozen=True)
class PodLayout:
    """How one shard maps onto pods.

    Attributes:
        pods_per_shard: pods that together hold one shard.
        gpus_per_pod: GPUs each pod requests (0 on a CPU fleet).
        ranks_per_pod: engine ranks (processes) each pod runs, one per GPU on a GPU fleet.
    """

    pods_per_shard: int
    gpus_per_pod: int
    ranks_per_pod: int

    def ranks_of_pod(self, pod: int) -> range:
        """Shard-local ranks held by pod ``pod``; pods take ranks contiguously in pod order."""
        if not 0 <= pod < self.pods_per_shard:
            raise ValueError(f"pod {pod} is outside 0..{self.pods_per_shard - 1}")
        return range(pod * self.ranks_per_pod, (pod + 1) * self.ranks_per_pod)


@dataclasses.dataclass(frozen=True)
class Membership:
    """Rank offsets of the live shards in the trainer+fleet refit communicator.

    Attributes:
        world_size: trainer ranks plus the ranks of every live shard.
        trainer_world_size: trainer ranks; they come first (0..trainer_world_size-1).
        offsets: shard index -> first global rank of that shard.
    """

    world_size: int
    trainer_world_size: int
    offsets: dict[int, int]


def _require_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def _require_valid(parallelism: Parallelism) -> None:
    _require_positive(
        tensor=parallelism.tensor,
        pipeline=parallelism.pipeline,
        context=parallelism.context,
        expert=parallelism.expert,
        expert_tensor=parallelism.expert_tensor,
    )


def rank_coordinates(parallelism: Parallelism, data_parallel: int) -> list[RankCoord]:
    """Coordinates of every rank of a world of ``data_parallel`` shards, in rank order.

    Args:
        parallelism: sizes of one shard.
        data_parallel: number of data-parallel replicas in the world (1 for one shard).

    Returns:
        One :class:`RankCoord` per rank ``0..TP*CP*DP*PP-1``, following
        ``arange(world).reshape(PP, DP, CP, TP)``.
    """
    _require_valid(parallelism)
    _require_positive(data_parallel=data_parallel)
    tp, cp, pp = parallelism.tensor, parallelism.context, parallelism.pipeline
    world = tp * cp * data_parallel * pp
    return [
        RankCoord(
            rank=rank,
            tp=rank % tp,
            cp=(rank // tp) % cp,
            dp=(rank // (tp * cp)) % data_parallel,
            pp=rank // (tp * cp * data_parallel),
        )
        for rank in range(world)
    ]


def frontend_ranks(parallelism: Parallelism, world_size: int) -> range:
    """Ranks that host an OpenAI frontend: those with ``tp_rank == 0 and pp_rank == 0``.

    Mirrors megatron-core's ``is_mp_coordinator``. With CP = 1 there is one frontend per
    data-parallel replica. The stride is TP, not TP * PP: PP is the slowest axis.

    Args:
        parallelism: sizes of one shard.
        world_size: ranks of the engine world; a multiple of ``parallelism.shard_size``.
    """
    _require_valid(parallelism)
    if world_size < 1 or world_size % parallelism.shard_size:
        raise ValueError(
            f"world size {world_size} is not a positive multiple of the shard size {parallelism.shard_size}"
        )
    return range(0, world_size // parallelism.pipeline, parallelism.tensor)


def pod_layout(parallelism: Parallelism, gpus_per_node: int) -> PodLayout:
    """Pods of one shard: one pod if the shard fits a node, else one whole node per pod.

    Args:
        parallelism: sizes of one shard.
        gpus_per_node: GPUs of one node (``spec.resources.gpusPerNode``); 0 means a CPU fleet,
            whose shard is one pod running one rank with no GPUs.

    Raises:
        ValueError: a CPU shard with more than one rank, or a shard larger than a node that
            is not a whole number of nodes.
    """
    _require_valid(parallelism)
    size = parallelism.shard_size
    if gpus_per_node < 0:
        raise ValueError(f"gpus_per_node must not be negative, got {gpus_per_node}")
    if gpus_per_node == 0:
        if size != 1:
            raise ValueError(f"a CPU shard runs one rank, but tensor x pipeline x context = {size}")
        return PodLayout(pods_per_shard=1, gpus_per_pod=0, ranks_per_pod=1)
    if size <= gpus_per_node:
        return PodLayout(pods_per_shard=1, gpus_per_pod=size, ranks_per_pod=size)
    if size % gpus_per_node:
        raise ValueError(f"a shard of {size} GPUs is not a whole number of {gpus_per_node}-GPU nodes")
    return PodLayout(pods_per_shard=size // gpus_per_node, gpus_per_pod=gpus_per_node, ranks_per_pod=gpus_per_node)


def needs_clique(parallelism: Parallelism, gpus_per_node: int) -> bool:
    """Whether a shard's pods must share one multi-node NVLink domain (clique).

    True when the NVLink span exceeds one node. A CPU fleet (``gpus_per_node == 0``) has no
    NVLink and never needs a clique.
    """
    if gpus_per_node <= 0:
        return False
    return parallelism.nvlink_span > gpus_per_node


def rank_offsets(trainer_world_size: int, live_shards: Sequence[int], shard_size: int) -> Membership:
    """Refit membership: trainer ranks first, then live shards packed in ascending shard index.

    A dead shard leaves no gap: the next live shard takes its place, as NeMo RL's
    ``plan_refit_membership`` does (the reshard destination mesh is contiguous).

    Args:
        trainer_world_size: ranks of the trainer side; they keep ranks 0..T-1.
        live_shards: indices of the shards that take part; order does not matter.
        shard_size: ranks of one shard.

    Raises:
        ValueError: a size below 1, a negative or repeated shard index.
    """
    _require_positive(trainer_world_size=trainer_world_size, shard_size=shard_size)
    shards = sorted(live_shards)
    if len(set(shards)) != len(shards):
        raise ValueError(f"live shards contain duplicates: {shards}")
    if shards and shards[0] < 0:
        raise ValueError(f"shard indices must not be negative: {shards}")
    offsets = {shard: trainer_world_size + position * shard_size for position, shard in enumerate(shards)}
    return Membership(
        world_size=trainer_world_size + len(shards) * shard_size,
        trainer_world_size=trainer_world_size,
        offsets=offsets,
    )
