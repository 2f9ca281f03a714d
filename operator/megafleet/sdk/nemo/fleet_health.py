"""NeMo RL's fleet-health monitor (``nemo_rl.models.generation.fleet_health.GenerationFleetHealth``) fed
from a fleet's status: the operator watches and heals the shards, and NeMo's monitor learns of it.

Used by :class:`~megafleet.sdk.nemo.membership.MembershipHooks` (``attach_fleet_health``). The monitor
is read by NeMo's names only (``shard_count``, ``state_of``, ``mark_restarting``, ``mark_loaded``,
``report_refit``, ``record_probe``; states by their values), so NeMo RL need not be importable.
NeMo's rule holds on both sides: a shard that restarted is ``stale`` until a completed refit, never
``healthy`` before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["Feed", "monitor_event"]

_SERVING = ("healthy", "suspect")
_COMING_UP = ("Pending", "Starting", "Loading", "Failed")


def monitor_event(phase: str, version: int | None, current: int | None, state: str) -> str | None:
    """What NeMo's monitor should be told of a shard in ``phase`` serving ``version`` while the fleet
    is at ``current`` and the monitor says ``state``: ``restarting``, ``loaded``, ``refit``, ``alive``
    or nothing."""
    if state == "retired":
        return None
    if phase in _COMING_UP:  # the operator re-places or reloads it
        return None if state == "restarting" else "restarting"
    up_to_date = phase in ("Ready", "Refitting", "Draining") and (current is None or version == current)
    if up_to_date:
        return "alive" if state in _SERVING else "refit"
    return None if state == "stale" else "loaded"  # Stale, or serving an older version


class Feed:
    """One attached monitor; :meth:`sync` folds a fleet status into it."""

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor

    def check(self, status: Mapping[str, Any]) -> None:
        """:class:`ValueError` when the monitor tracks another number of shards than the fleet has."""
        shards = int(status.get("replicas", len(status.get("shards") or ())))
        if int(self.monitor.shard_count) != shards:
            raise ValueError(f"fleet monitor tracks {self.monitor.shard_count} shards but the fleet has {shards}")

    def sync(self, status: Mapping[str, Any]) -> list[tuple[int, str]]:
        """Tell the monitor what changed; returns ``(shard, event)`` of what it was told."""
        current = (status.get("refit") or {}).get("currentVersion")
        told = []
        for shard in status.get("shards") or ():
            index = int(shard["index"])
            if index >= int(self.monitor.shard_count):
                continue
            state = getattr(self.monitor.state_of(index), "value", str(self.monitor.state_of(index)))
            event = monitor_event(str(shard.get("phase")), shard.get("weightVersion"), current, str(state))
            if event == "restarting":
                self.monitor.mark_restarting(index)
            elif event == "loaded":
                self.monitor.mark_loaded(index)
            elif event == "refit":
                self.monitor.report_refit(index, weight_version=int(current or shard.get("weightVersion") or 0))
            elif event == "alive":
                self.monitor.record_probe(index, ok=True)
            if event is not None:
                told.append((index, event))
        return told
