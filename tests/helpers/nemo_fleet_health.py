"""Stand-ins for NeMo RL's refit membership and fleet-health monitor, for the tests of the adapter's
``set_refit_membership`` / ``rebuild_collective`` / ``attach_fleet_health`` (it holds no tests).
Written from NeMo RL's contract (``nemo_rl/weight_sync/membership.py``,
``nemo_rl/models/generation/fleet_health.py``), not from the adapter:

* :class:`RefitMembership` and :func:`plan_refit_membership`: the survivors packed contiguously after
  the trainer's ranks, in ascending shard index.
* :class:`ShardState` and :class:`Monitor`: NeMo's monitor transitions (probes never resurrect a shard
  out of service, a loaded replacement is STALE, only a completed refit makes it HEALTHY).
"""

from __future__ import annotations

import dataclasses
import enum


@dataclasses.dataclass(frozen=True)
class RefitMembership:
    """NeMo's membership: survivors packed contiguously after the trainer's ranks."""

    world_size: int
    train_world_size: int
    shard_prefixes: dict[int, int]
    workers_per_shard: int


def plan_refit_membership(surviving: list[int], *, per_shard: int, train_world_size: int) -> RefitMembership:
    """NeMo's ``plan_refit_membership``: ascending survivors, prefix = position x workers per shard."""
    shards = sorted(set(surviving))
    return RefitMembership(
        train_world_size + len(shards) * per_shard,
        train_world_size,
        {shard: position * per_shard for position, shard in enumerate(shards)},
        per_shard,
    )


class ShardState(enum.StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DEAD = "dead"
    RESTARTING = "restarting"
    STALE = "stale"
    RETIRED = "retired"


class Monitor:
    """NeMo's ``GenerationFleetHealth`` transitions: probes never resurrect a shard out of service,
    a loaded replacement is STALE, only a completed refit makes it HEALTHY."""

    def __init__(self, shard_count: int) -> None:
        self.shard_count = shard_count
        self.states = dict.fromkeys(range(shard_count), ShardState.HEALTHY)
        self.calls: list[tuple[str, int]] = []

    def state_of(self, shard: int) -> ShardState:
        return self.states[shard]

    def serving_shards(self) -> list[int]:
        """The shards NeMo dispatches to and keeps in its refit membership."""
        return [shard for shard, state in self.states.items() if state in (ShardState.HEALTHY, ShardState.SUSPECT)]

    def record_probe(self, shard: int, *, ok: bool, error: str = "") -> None:
        self.calls.append(("record_probe", shard))

    def mark_restarting(self, shard: int) -> None:
        self.calls.append(("mark_restarting", shard))
        self.states[shard] = ShardState.RESTARTING

    def mark_loaded(self, shard: int) -> None:
        self.calls.append(("mark_loaded", shard))
        self.states[shard] = ShardState.STALE

    def report_refit(self, shard: int, *, weight_version: int) -> None:
        self.calls.append(("report_refit", shard))
        self.states[shard] = ShardState.HEALTHY
