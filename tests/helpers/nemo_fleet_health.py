"""Stand-ins for NeMo RL's refit membership and fleet-health monitor, for the tests of the adapter's
``set_refit_membership`` / ``rebuild_collective`` / ``attach_fleet_health`` (it holds no tests).
Written from NeMo RL's contract (``nemo_rl/weight_sync/membership.py``,
``nemo_rl/models/generation/fleet_health.py``), not from the adapter:

* :class:`RefitMembership` and :func:`plan_refit_membership`: the survivors packed contiguously after
  the trainer's ranks, in ascending shard index.
* :class:`ShardState` and :class:`Monitor`: NeMo's monitor transitions (probes never resurrect a shard
  out of service, a loaded replacement is STALE, only a completed refit makes it HEALTHY, a retired
  shard stays retired), kept as NeMo keeps them (``_shards``: a :class:`ShardHealth` per shard), and
  its ``absent_shards`` (DEAD, RESTARTING, RETIRED: the shards a rebuild leaves out).
* :func:`desired_members`: NeMo's ``desired_membership``, the shards a rebuild names (every tracked
  shard not absent; NeMo counts them from its generation's ``dp_size``, here the monitor's shard count).
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


ABSENT = (ShardState.DEAD, ShardState.RESTARTING, ShardState.RETIRED)


@dataclasses.dataclass
class ShardHealth:
    """NeMo's per-shard record (the fields the adapter may touch)."""

    dp_shard_idx: int
    state: ShardState = ShardState.HEALTHY
    weight_version: int = 0
    last_error: str = ""


class Monitor:
    """NeMo's ``GenerationFleetHealth`` transitions: probes never resurrect a shard out of service,
    a loaded replacement is STALE, only a completed refit makes it HEALTHY, a retired shard stays so."""

    def __init__(self, shard_count: int) -> None:
        self._shards = {index: ShardHealth(index) for index in range(shard_count)}
        self.calls: list[tuple[str, int]] = []

    @property
    def shard_count(self) -> int:
        return len(self._shards)

    @property
    def states(self) -> dict[int, ShardState]:
        return {index: health.state for index, health in sorted(self._shards.items())}

    def state_of(self, shard: int) -> ShardState:
        return self._shards[shard].state

    def serving_shards(self) -> list[int]:
        """The shards NeMo dispatches to."""
        return [shard for shard, state in self.states.items() if state in (ShardState.HEALTHY, ShardState.SUSPECT)]

    def absent_shards(self) -> list[int]:
        """The shards whose process cannot take part in a collective (a rebuild leaves them out)."""
        return [shard for shard, state in self.states.items() if state in ABSENT]

    def record_probe(self, shard: int, *, ok: bool, error: str = "") -> None:
        self.calls.append(("record_probe", shard))

    def mark_restarting(self, shard: int) -> None:
        self.calls.append(("mark_restarting", shard))
        if self._shards[shard].state is not ShardState.RETIRED:
            self._shards[shard].state = ShardState.RESTARTING

    def mark_loaded(self, shard: int) -> None:
        self.calls.append(("mark_loaded", shard))
        if self._shards[shard].state is not ShardState.RETIRED:
            self._shards[shard].state = ShardState.STALE

    def report_refit(self, shard: int, *, weight_version: int) -> None:
        self.calls.append(("report_refit", shard))
        if self._shards[shard].state is not ShardState.RETIRED:
            self._shards[shard].state = ShardState.HEALTHY
            self._shards[shard].weight_version = weight_version

    def retire(self, shard: int, *, reason: str) -> None:
        self.calls.append(("retire", shard))
        self._shards[shard].state = ShardState.RETIRED
        self._shards[shard].last_error = reason


def desired_members(monitor: Monitor) -> list[int]:
    """NeMo's ``desired_membership``: every tracked shard that is not absent."""
    return [shard for shard in range(monitor.shard_count) if shard not in monitor.absent_shards()]
