"""The conditions that say whether a fleet serves: Ready, Degraded and WeightsCurrent.

Pure; called by the reconcile from what it observed (:func:`megafleet.reconcile.status.observed`)
and by the Refit controller in the patch that ends a successful refit
(:func:`megafleet.refits.refit_status.settled_status`), so readiness after a refit does not wait
for the reconcile's next pass. Each function returns a new condition list; a condition's transition
time changes only when its status does (:func:`megafleet.conditions.set_condition`).
"""

from __future__ import annotations

from collections.abc import Sequence

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


def reconciling(
    found: list[conditions.Condition], changes: Sequence[str], *, generation: int, now: str
) -> list[conditions.Condition]:
    """Reconciling (kstatus's convention): True while ``changes`` of the spec are not applied to the
    shards yet (:func:`megafleet.fleet_state.hold.unapplied` names them), so a reader of kstatus (Flux's
    health check) sees the fleet in progress during a roll even while every old shard still serves."""
    if changes:
        verdict = conditions.Verdict(True, "Progressing", f"applying {' and '.join(changes)}")
    else:
        verdict = conditions.Verdict(False, "AsDesired", "")
    return conditions.set_condition(found, conditions.RECONCILING, verdict, generation=generation, now=now)


MESSAGE_CHARACTERS = 2000
"""The longest Degraded message :func:`degraded` writes (each failing shard's line holds its
``lastError``, up to a termination message's 1,000 characters)."""


def degraded(
    found: list[conditions.Condition],
    ready: int,
    replicas: int,
    *,
    failing: Sequence[str] = (),
    generation: int,
    now: str,
) -> list[conditions.Condition]:
    """Degraded: some shards serve, not all; or a shard is not ready after restarts (``failing``: one
    line per such shard saying why, from the reconcile's observation), even when none serves. A fleet
    whose shards are all still starting for the first time is not Ready, but not Degraded."""
    if failing:
        message = f"{len(failing)} of {replicas} shards not ready after restarts: {'; '.join(failing)}"
        if len(message) > MESSAGE_CHARACTERS:
            message = message[: MESSAGE_CHARACTERS - 3] + "..."
        verdict = conditions.Verdict(True, "ShardsFailing", message)
    elif 0 < ready < replicas:
        verdict = conditions.Verdict(True, "ShardsUnavailable", f"{replicas - ready} of {replicas} shards not ready")
    else:
        verdict = conditions.Verdict(False, "AsDesired", "")
    return conditions.set_condition(found, conditions.DEGRADED, verdict, generation=generation, now=now)


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
