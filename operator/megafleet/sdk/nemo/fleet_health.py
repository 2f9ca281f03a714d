"""NeMo RL's fleet-health monitor (``nemo_rl.models.generation.fleet_health.GenerationFleetHealth``) fed
from a fleet's status: the operator watches, heals and scales the shards, and NeMo's monitor learns of it.

Used by :class:`~megafleet.sdk.nemo.membership.MembershipHooks` (``attach_fleet_health``). The monitor
is read by NeMo's names only (``shard_count``, ``state_of``, ``mark_restarting``, ``mark_loaded``,
``report_refit``, ``record_probe``, ``retire``; states by their values), so NeMo RL need not be
importable. NeMo's rule holds on both sides: a shard that restarted is ``stale`` until a completed
refit, never ``healthy`` before.

Scaling, which NeMo's monitor does not know (it tracks the shard count it was made with): a shard a
scale-in leaves out of ``spec.replicas`` is retired (``retire``), so NeMo's next rebuild
(``absent_shards``, then ``set_refit_membership`` / ``rebuild_collective``) leaves it out and the
operator removes it; a shard a scale-out adds is added to the monitor ``restarting`` (its
``add_shard`` if it has one, else an entry of its own kind in NeMo's ``_shards``) and follows NeMo's
rule from there: ``stale`` once loaded, named by NeMo's next rebuild, ``healthy`` after a refit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["Feed", "add_shard", "monitor_event"]

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
        self.scaled_in: set[int] = set()
        """The shards this feed retired for a scale-in (a later scale-out adds them back)."""

    def check(self, status: Mapping[str, Any]) -> None:
        """:class:`ValueError` when the monitor tracks another number of shards than the fleet has."""
        shards = int(status.get("replicas", len(status.get("shards") or ())))
        if int(self.monitor.shard_count) != shards:
            raise ValueError(f"fleet monitor tracks {self.monitor.shard_count} shards but the fleet has {shards}")

    def sync(self, status: Mapping[str, Any]) -> list[tuple[int, str]]:
        """Tell the monitor what changed (``status.shards`` lists every shard of ``spec.replicas``);
        returns ``(shard, event)`` of what it was told (``retire`` and ``add`` for a scale)."""
        current = (status.get("refit") or {}).get("currentVersion")
        entries = {int(shard["index"]): shard for shard in status.get("shards") or ()}
        told = self._scale(entries) if entries else []  # no shards listed: nothing known, nothing retired
        for index, shard in sorted(entries.items()):
            state = _state(self.monitor, index)
            event = monitor_event(str(shard.get("phase")), shard.get("weightVersion"), current, state)
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

    def _scale(self, entries: Mapping[int, Any]) -> list[tuple[int, str]]:
        """Retire the tracked shards the fleet no longer lists, add those it lists anew."""
        told = []
        replicas = len(entries)
        for index in range(int(self.monitor.shard_count)):
            if index not in entries and index not in self.scaled_in and _state(self.monitor, index) != "retired":
                self.monitor.retire(index, reason=f"the fleet scaled in to {replicas} shards")
                self.scaled_in.add(index)
                told.append((index, "retire"))
        for index in sorted(entries):
            if index >= int(self.monitor.shard_count) or index in self.scaled_in:
                add_shard(self.monitor, index)
                self.scaled_in.discard(index)
                told.append((index, "add"))
        return told


def _state(monitor: Any, index: int) -> str:
    state = monitor.state_of(index)
    return str(getattr(state, "value", state))


def add_shard(monitor: Any, index: int) -> None:
    """Track shard ``index`` in NeMo's monitor as ``restarting`` (coming up, absent from refits), anew
    if it was retired: the monitor's ``add_shard`` when it has one; NeMo's ``GenerationFleetHealth``
    has none, so an entry of its own kind (``ShardHealth``) goes into its ``_shards``.

    Raises:
        TypeError: a monitor that can be neither.
    """
    add = getattr(monitor, "add_shard", None)
    if callable(add):
        add(index)
        return
    shards = getattr(monitor, "_shards", None)
    if not isinstance(shards, dict) or not shards:
        raise TypeError(f"cannot add shard {index} to fleet monitor {type(monitor).__name__}: it has no _shards")
    template = next(iter(shards.values()))
    entry = type(template)(dp_shard_idx=index)
    entry.state = type(template.state)("restarting")
    shards[index] = entry
