"""A Refit's status and the fleet status a Refit writes: pure functions under table tests.

Called by the Refit controller's steps (:mod:`.refit_controller`, :mod:`.attempts`,
:mod:`.session_refits`, :mod:`.fleet_lock`). Each function returns a new status or patch:

* admission: the version a new Refit must be above (:func:`current_version`) and why a Pending
  Refit is refused (:func:`refused`: ``VersionNotNewer``, ``SessionHeld``);
* the membership a Refit (and a RefitSession) publishes (:func:`membership`);
* the end: the :class:`Outcome` of a refit, the Refit's last status (:func:`final`), the fleet's
  patch that releases it and, on success, moves ``status.refit.currentVersion`` on, records how the
  refit treated the sequences in flight (:func:`last_in_flight`) and settles the member shards'
  readiness (:func:`released_fleet`, :func:`settled_status`, :func:`settled_shards`);
* pruning: which finished Refits go (:func:`prunable`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from megafleet import conditions, planner
from megafleet.api import v1alpha1
from megafleet.fleet_state import readiness
from megafleet.objects import Object
from megafleet_protocol import agent_api

FINISHED = ("Succeeded", "Failed")
"""Phases a Refit never leaves."""
KEEP_UNAVAILABLE = "KeepUnavailable"
"""Condition of a Refit that asked to keep the sequences in flight whose members drained instead
(its reason: ``BackendCannotKeep``, ``KvCacheModeNotKept``, ``EngineDrained``, see :mod:`.modes`)."""
INVALID_SPEC = "InvalidSpec"
"""Reason of the Failed condition of a Refit whose spec does not parse (admitted by an older CRD)."""
VERSION_NOT_NEWER = "VersionNotNewer"
"""Reason of the Failed condition of a Refit whose version is not above the fleet's current one."""
SESSION_HELD = "SessionHeld"
"""Reason of the Failed condition of a rendezvous or checkpoint Refit of a fleet a RefitSession holds."""
SESSION_NOT_JOINED = "SessionNotJoined"
"""Reason of the Failed condition of a Refit through a RefitSession that is not Joined (or not this fleet's)."""
REFIT_INFO_MISSING = "RefitInfoMissing"
"""Reason of the Failed condition of a NeMo session Refit whose session has no usable refit info."""
BUCKET_MISMATCH = "BucketMismatch"
"""Reason of the Failed condition of a Refit whose member received a bucket that did not match its digest."""
NON_FINITE_WEIGHTS = "NonFiniteWeights"
"""Reason of the Failed condition of a Refit whose member received weights with NaN or Inf values."""
STAGING_UNAVAILABLE = "StagingUnavailable"
"""Reason of the Failed condition of a Refit with ``staging: required`` that a member cannot stage."""
DIGEST_DISAGREEMENT = "DigestDisagreement"
"""Reason of the Failed condition of a Refit whose members' bucket digests disagree (NeMo's wire)."""
COMMIT_EXPIRED = "CommitExpired"
"""Reason of the Failed condition of a Refit whose staged members' wait for the commit ran out (nothing switched)."""
DEGRADED = "Degraded"
"""Condition of a Refit that succeeded although a member failed to switch after the commit (its shard is fenced)."""
SWITCH_FAILED = "SwitchFailed"
"""Degraded's reason: a member failed after the commit; its shard went Stale and catches up as a Stale shard does."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a Refit ends: ``phase`` Succeeded or Failed, with the condition's ``reason`` (the phase
    when None) and ``message``; a success also carries what the fleet's status records of it."""

    phase: str
    message: str
    reason: str | None = None
    phases: list[Object] | None = None
    """The longest time any member spent in each refit phase."""
    duration: int | None = None
    """Milliseconds, the longest of the members'."""
    version: int | None = None
    """The version the fleet now serves (None: the fleet's version does not move)."""
    checkpoint: str | None = None
    """Where that version came from, for shards that catch up later (None: not a checkpoint)."""
    serving: tuple[int, ...] = ()
    """The member shards whose agents reported the new version ready."""
    report: Object | None = None
    """The members' reports as Refit status fields (``inFlight``, ``staging``, ``pause``,
    ``verification``), see :mod:`.member_reports`; on success the fleet keeps ``lastInFlight`` and
    ``lastStallMilliseconds`` from them."""
    keep_unavailable: conditions.Verdict | None = None
    """Set: the Refit's condition KeepUnavailable (a member drained on its own although told to keep)."""
    fenced: tuple[tuple[int, str], ...] = ()
    """Member shards that failed to switch after the commit, and why: Stale in the fleet, the Refit Degraded."""


def failed(message: str, reason: str | None = None, *, report: Object | None = None) -> Outcome:
    return Outcome("Failed", message, reason=reason, report=report)


def fenced(outcome: Outcome, shards: dict[int, str]) -> Outcome:
    """A success whose member ``shards`` failed after the commit (shard -> why): they are fenced."""
    found = tuple(sorted(shards.items()))
    named = ", ".join(str(shard) for shard, _ in found)
    message = f"{outcome.message}; shards {named} failed to switch after the commit and are Stale"
    return dataclasses.replace(outcome, message=message, fenced=found)


def current_version(fleet_status: Object) -> int | None:
    """The version a new Refit must be above: ``status.refit.currentVersion`` (the last successful
    Refit's), else the version every Ready shard serves (the checkpoint's 0 before any refit), else
    ``None`` (no weights anywhere yet: any version may come first)."""
    found = (fleet_status.get("refit") or {}).get("currentVersion")
    if found is None:
        found = fleet_status.get("weightVersion")
    return None if found is None else int(found)


def refused(spec: v1alpha1.RefitObjectSpec, fleet_status: Object) -> Outcome | None:
    """Why a Pending Refit ends before anything is sent to an agent, or None: versions never go
    backwards (``VersionNotNewer``), and while a session holds the fleet only a Refit through it
    may run (``SessionHeld``)."""
    fleet = spec.fleet_ref.name
    current = current_version(fleet_status)
    if current is not None and spec.version <= current:
        message = (
            f"version {spec.version} is not above fleet {fleet}'s current version {current}: "
            "versions never go backwards (create a Refit with a higher version)"
        )
        return failed(message, VERSION_NOT_NEWER)
    held = (fleet_status.get("refit") or {}).get("session")
    if spec.source.session is None and held is not None:
        source = "checkpoint" if spec.source.checkpoint is not None else "rendezvous"
        message = (
            f"fleet {fleet} is held by RefitSession {held}: a {source} refit would drop "
            "its members' place in the trainer's world (refit through the session, or delete it first)"
        )
        return failed(message, SESSION_HELD)
    return None


def membership(found: planner.Membership) -> Object:
    """A membership as the Refit and RefitSession statuses (and the fleet's ``status.refit``) publish it."""
    return {
        "worldSize": found.world_size,
        "trainerWorldSize": found.trainer_world_size,
        "rankOffsets": [{"shard": shard, "offset": offset} for shard, offset in sorted(found.offsets.items())],
    }


def succeeded(
    spec: v1alpha1.RefitObjectSpec,
    members: list[int],
    reports: list[agent_api.RefitStatusResponse],
    serving: list[int],
    *,
    report: Object | None = None,
    keep_unavailable: conditions.Verdict | None = None,
) -> Outcome:
    """The outcome of an attempt every member's agents reported succeeded: the longest time any
    spent in each phase, the longest duration, the new version and where it came from; ``report``
    and ``keep_unavailable`` as :class:`Outcome` says."""
    phases: dict[str, int] = {}
    for answer in reports:
        for timing in answer.phases:
            phases[timing.name] = max(phases.get(timing.name, 0), timing.milliseconds)
    return Outcome(
        "Succeeded",
        f"{len(members)} shards serve version {spec.version}",
        phases=[{"name": name, "milliseconds": milliseconds} for name, milliseconds in phases.items()],
        duration=max(answer.duration_milliseconds or 0 for answer in reports),
        version=spec.version,
        checkpoint=spec.source.checkpoint.path if spec.source.checkpoint is not None else None,
        serving=tuple(serving),
        report=report,
        keep_unavailable=keep_unavailable,
    )


def final(refit: Object, outcome: Outcome, now: str) -> Object:
    """The Refit's last status update: phase, message, completion time, its Complete (or Failed)
    condition (and KeepUnavailable when the outcome says so), the members' report, and a success's
    phases and duration."""
    generation = int(refit["metadata"].get("generation", 1))
    found = conditions.set_condition(
        list((refit.get("status") or {}).get("conditions", [])),
        "Complete" if outcome.phase == "Succeeded" else "Failed",
        conditions.Verdict(True, outcome.reason or outcome.phase, outcome.message),
        generation=generation,
        now=now,
    )
    if outcome.keep_unavailable is not None:
        found = conditions.set_condition(
            found, KEEP_UNAVAILABLE, outcome.keep_unavailable, generation=generation, now=now
        )
    if outcome.fenced:
        why = "; ".join(message for _, message in outcome.fenced)
        verdict = conditions.Verdict(True, SWITCH_FAILED, f"fenced Stale after the commit: {why}")
        found = conditions.set_condition(found, DEGRADED, verdict, generation=generation, now=now)
    update: Object = {"phase": outcome.phase, "message": outcome.message, "completionTime": now, "conditions": found}
    update.update(outcome.report or {})
    if outcome.phases is not None:
        update["phases"] = outcome.phases
    if outcome.duration is not None:
        update["durationMilliseconds"] = outcome.duration
    return update


def released_fleet(fleet_body: Object, refit: str, outcome: Outcome, now: str) -> Object | None:
    """The fleet's status patch that ends Refit ``refit``: ``status.refit.active`` cleared and, on
    success, the current version moved on (never back: a retried finish after a later Refit ended
    leaves it) with the member shards' readiness settled in the same patch, so no reader sees the
    new version without its shards. None when another Refit holds the fleet (nothing to write)."""
    fleet_refit = dict(((fleet_body.get("status") or {}).get("refit")) or {})
    if fleet_refit.get("active") not in (None, refit):
        return None
    version = outcome.version
    current = fleet_refit.get("currentVersion")
    if version is not None and isinstance(current, int) and current > version:
        version = None  # a retried finish after a later Refit ended: the version never goes back
    fleet_refit["active"] = None
    if version is not None:
        fleet_refit.update(
            {"currentVersion": version, "lastDurationMilliseconds": outcome.duration, "lastPhases": outcome.phases}
        )
        if outcome.report is not None:
            fleet_refit.update(last_in_flight(outcome.report))
        # What a shard that falls behind this version catches up from (None: the next refit).
        fleet_refit["currentCheckpoint"] = outcome.checkpoint
    patch: Object = {"refit": fleet_refit}
    fleet_status = fleet_body.get("status") or {}
    if version is not None and outcome.fenced and fleet_status.get("shards"):
        fleet_status = {**fleet_status, "shards": fenced_shards(fleet_status["shards"], outcome.fenced)}
        patch["shards"] = fleet_status["shards"]
    if version is not None and outcome.serving and fleet_status.get("shards"):
        replicas = int((fleet_body.get("spec") or {}).get("replicas", 1))
        generation = int(fleet_body["metadata"].get("generation", 1))
        patch.update(
            settled_status(fleet_status, outcome.serving, version, replicas=replicas, generation=generation, now=now)
        )
    return patch


def last_in_flight(report: Object) -> Object:
    """What the fleet's ``status.refit`` keeps of a successful Refit's report: ``lastInFlight`` (the
    mode the members ran, the KV mode, staged or in place) and ``lastStallMilliseconds`` (the longest
    shard's stall); None for what the report does not say (an engine that reports neither)."""
    in_flight, staging, pause = report.get("inFlight"), report.get("staging"), report.get("pause")
    last: Object = {"lastInFlight": None, "lastStallMilliseconds": None}
    if in_flight is not None:
        last["lastInFlight"] = {
            "mode": in_flight["effective"],
            "kvCacheMode": in_flight["kvCacheMode"],
            "staging": (staging or {}).get("effective", "inPlace"),
        }
    if pause is not None:
        last["lastStallMilliseconds"] = pause["stallMaxMilliseconds"]
    return last


def settled_status(
    fleet_status: Object, serving: Iterable[int], version: int, *, replicas: int, generation: int, now: str
) -> Object:
    """The fleet status fields a successful refit settles at once: the member shards (see
    :func:`settled_shards`), ``readyReplicas``, ``weightVersion`` when every Ready shard serves
    ``version``, and the Ready, Degraded and WeightsCurrent conditions, computed as the reconcile
    computes them, so readiness does not wait for its next pass (a ``ShardsFailing`` Degraded, which
    needs the reconcile's view of restarts, is kept until every shard is Ready)."""
    shards = settled_shards(fleet_status.get("shards") or [], serving, version)
    ready = sum(1 for entry in shards if entry.get("phase") == "Ready")
    found = list(fleet_status.get("conditions") or [])
    found = readiness.ready_condition(found, ready, replicas, generation=generation, now=now)
    previous = conditions.find(found, conditions.DEGRADED)
    if not (previous is not None and previous.get("reason") == "ShardsFailing" and ready < replicas):
        # A shard not ready after restarts stays named (only the reconcile observes restarts): a
        # refit that leaves some shard unsettled never turns ShardsFailing into ShardsUnavailable.
        found = readiness.degraded(found, ready, replicas, generation=generation, now=now)
    found = readiness.weights_current(found, shards, {"currentVersion": version}, generation=generation, now=now)
    settled: Object = {"shards": shards, "readyReplicas": ready, "conditions": found}
    if {entry.get("weightVersion") for entry in shards if entry.get("phase") == "Ready"} == {version}:
        settled["weightVersion"] = version
    return settled


def settled_shards(shards: Iterable[Object], serving: Iterable[int], version: int) -> list[Object]:
    """``status.shards`` after a successful refit: each shard in ``serving`` (its agents reported
    the refit succeeded, engine ready at ``version``) is ``Ready`` at ``version``; others as they were
    (the reconcile's next pass observes them, and marks those behind ``Stale``)."""
    settled = set(serving)
    updated = []
    for entry in shards:
        if entry.get("index") in settled:
            entry = {**entry, "phase": "Ready", "weightVersion": version}
            entry.pop("lastError", None)
        updated.append(entry)
    return updated


def fenced_shards(shards: Iterable[Object], fenced: Iterable[tuple[int, str]]) -> list[Object]:
    """``status.shards`` with each shard that failed to switch after a commit ``Stale`` (never routed;
    it catches up as any Stale shard does), its ``lastError`` saying why."""
    why = dict(fenced)
    return [
        {**entry, "phase": "Stale", "lastError": why[entry["index"]]} if entry.get("index") in why else entry
        for entry in shards
    ]


def prunable(refits: Iterable[Object], limit: int) -> list[str]:
    """Names of the Refits (all of one fleet) to delete so that ``limit`` finished ones remain.

    Only finished Refits (Succeeded, Failed) are ever chosen, oldest first by creation (then
    version, then name). Never chosen: a Pending or Running Refit, the last created (whatever its
    phase: the one a trainer is most likely still watching, e.g. one just refused as
    ``VersionNotNewer``) and the one of the highest version (the fleet's current). Kept ones count
    towards ``limit`` when finished."""
    every = sorted(refits, key=_created)
    if not every:
        return []
    kept = {every[-1]["metadata"]["name"], max(every, key=_versioned)["metadata"]["name"]}
    finished = [item for item in every if (item.get("status") or {}).get("phase") in FINISHED]
    excess = len(finished) - max(limit, 0)
    chosen = [item["metadata"]["name"] for item in finished if item["metadata"]["name"] not in kept]
    return chosen[: max(excess, 0)]


def _created(item: Object) -> tuple[str, int, str]:
    return item["metadata"].get("creationTimestamp", ""), int(item["spec"]["version"]), item["metadata"]["name"]


def _versioned(item: Object) -> tuple[int, str, str]:
    return int(item["spec"]["version"]), item["metadata"].get("creationTimestamp", ""), item["metadata"]["name"]
