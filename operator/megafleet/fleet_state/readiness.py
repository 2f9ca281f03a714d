"""The conditions that say whether a fleet serves: Ready, Degraded and WeightsCurrent.

Pure; called by the reconcile from what it observed (:func:`megafleet.reconcile.status.observed`)
and by the Refit controller in the patch that ends a successful refit
(:func:`megafleet.refits.refit_status.settled_status`), so readiness after a refit does not wait
for the reconcile's next pass. Each function returns a new condition list; a condition's transition
time changes only when its status does (:func:`megafleet.conditions.set_condition`).
"""

from __future__ import annotations

from megafleet import conditions
from megafleet.objects import Object


def ready_condition(
    found: list[conditions.Condition], ready: int, replicas: int, *, generation: int, now: str
) -> list[conditions.Condition]:
    """Ready: every shard serves."""
    every = ready == replicas
    reason = "AllShardsReady" if every else "ShardsNotReady"
    message = f"{ready} of {replicas} shards ready"
    return conditions.set_condition(
        found, conditions.READY, conditions.Verdict(every, reason, message), generation=generation, now=now
    )


def degraded(
    found: list[conditions.Condition], ready: int, replicas: int, *, generation: int, now: str
) -> list[conditions.Condition]:
    """Degraded: some shards serve, not all (none serving is not Ready, but not Degraded)."""
    is_degraded = 0 < ready < replicas
    reason = "ShardsUnavailable" if is_degraded else "AsDesired"
    message = f"{replicas - ready} of {replicas} shards not ready" if is_degraded else ""
    return conditions.set_condition(
        found, conditions.DEGRADED, conditions.Verdict(is_degraded, reason, message), generation=generation, now=now
    )


def weights_current(
    found: list[conditions.Condition], entries: list[Object], refit: Object, *, generation: int, now: str
) -> list[conditions.Condition]:
    """WeightsCurrent: every shard serves the fleet's current version (the last successful Refit's,
    else the one every shard started with) and no refit is running."""
    if refit.get("active"):
        message = f"refit {refit['active']} is running"
        return conditions.set_condition(
            found,
            conditions.WEIGHTS_CURRENT,
            conditions.Verdict(False, "Refitting", message),
            generation=generation,
            now=now,
        )
    versions = {entry.get("weightVersion") for entry in entries}
    target = refit.get("currentVersion")
    current = (
        bool(entries) and None not in versions and (versions == {target} if target is not None else len(versions) == 1)
    )
    stale = sorted(entry["index"] for entry in entries if target is not None and entry.get("weightVersion") != target)
    message = (
        f"every shard serves version {versions.pop()}"
        if current
        else f"shards {stale} are not at version {target}"
        if stale
        else "not every shard has weights yet"
    )
    reason = "Current" if current else "Behind"
    return conditions.set_condition(
        found, conditions.WEIGHTS_CURRENT, conditions.Verdict(current, reason, message), generation=generation, now=now
    )
