"""The fleet's status: shard entries and phases from agent reports, counters, and conditions.

Pure except :func:`write`; called by :func:`megafleet.reconcile.reconcile` and its steps. Each
function returns a new status or condition list; recomputing an unchanged state yields an equal
status, and :func:`write` patches only what changed, so an idle reconcile writes nothing. The Ready,
Degraded and WeightsCurrent conditions are built by :mod:`megafleet.fleet_state.readiness`, which
the Refit controller also calls when a refit settles.
"""

from __future__ import annotations

import dataclasses

from megafleet import agent_client, conditions, desired, kube
from megafleet.api import v1alpha1
from megafleet.fleet_state import patches, pods, readiness
from megafleet.objects import Object

Report = agent_client.AgentState | None

_AGENT_PHASES = {"loading": "Loading", "stale": "Stale", "suspended": "Refitting", "failed": "Failed"}
"""Agent states that make a shard's phase, the first found winning."""


def raw_phase(reports: list[Report]) -> tuple[str, str | None, int | None]:
    """(shard phase, error, weight version) from the agents of one shard's pods, in pod order."""
    if any(report is None for report in reports):
        return "Starting", None, None
    answered = [report for report in reports if report is not None]
    for report in answered:
        if report.error is not None:
            return "Starting", report.error, None
    for state, phase in _AGENT_PHASES.items():
        failing = [report for report in answered if report.state == state]
        if failing:
            return phase, failing[0].last_error, failing[0].weight_version
    return "Ready", None, answered[0].weight_version if answered else None


def shard_phase(reports: list[Report], current_version: int | None = None) -> tuple[str, str | None, int | None]:
    """:func:`raw_phase`, but a shard not at the fleet's ``current_version`` is Stale."""
    phase, error, version = raw_phase(reports)
    if current_version is not None and phase in ("Ready", "Refitting") and version != current_version:
        return "Stale", f"serves version {version}, the fleet is at {current_version}", version
    if current_version is not None and phase == "Loading":  # started after a refit, without weights
        return "Stale", f"has no weights yet, the fleet is at version {current_version}", version
    return phase, error, version


@dataclasses.dataclass(frozen=True)
class ShardSeen:
    """What one reconcile saw of one shard, as :func:`shard_entry` reads it."""

    members: list[pods.Pod] | None
    """Its pods in pod order, or None when it has none."""
    unplaced: str | None = None
    """Why it could not be placed this time, if it could not."""
    restarts: tuple[int, str | None] = (0, None)
    """How often it was placed again, and the last error the status holds."""
    reports: list[Report] = dataclasses.field(default_factory=list)
    """Its pods' agent answers, in pod order (None: no answer)."""
    terminating: bool = False
    """Its pods are being deleted (a scale-down drains it)."""

    @property
    def engine_exit(self) -> str | None:
        """Why an engine of its pods last exited on an error, naming the pod and how often the
        kubelet restarted it (the container's termination message: :attr:`pods.Pod.exit_reason`)."""
        for pod in self.members or []:
            if pod.exit_reason is not None:
                restarted = f" (restarted {pod.engine_restarts} times)" if pod.engine_restarts else ""
                return f"{pod.name}{restarted}: {pod.exit_reason}"
        return None

    @property
    def restarted(self) -> bool:
        """It was placed again, or the kubelet restarted one of its engines."""
        return self.restarts[0] > 0 or any(pod.engine_restarts for pod in self.members or [])


@dataclasses.dataclass(frozen=True)
class FleetSeen:
    """What one reconcile saw of the whole fleet, as :func:`observed` reads it."""

    shards: pods.Shards
    unplaced: dict[int, str]
    restarts: dict[int, tuple[int, str | None]]
    reports: pods.Reports

    def shard(self, shard: int) -> ShardSeen:
        return ShardSeen(
            self.shards.pods.get(shard),
            unplaced=self.unplaced.get(shard),
            restarts=self.restarts.get(shard, (0, None)),
            reports=self.reports.get(shard, []),
            terminating=shard in self.shards.terminating,
        )


def shard_entry(shard: int, seen: ShardSeen, *, current_version: int | None, max_restarts: int) -> Object:
    """One item of ``status.shards``."""
    members, (count, last_error) = seen.members, seen.restarts
    entry: Object = {"index": shard, "restarts": count}
    if members:
        entry["pods"] = [pod.name for pod in members]
        # The node each pod is pinned to until it is bound there: known at placement, so binding
        # (one event per pod) changes nothing the status shows and writes nothing.
        entry["nodes"] = [pod.placed_on for pod in members]
        if members[0].clique is not None:
            entry["clique"] = members[0].clique
        phase, agent_error, version = shard_phase(seen.reports, current_version)
        entry["phase"] = phase
        # A shard that serves again has recovered: only its restart count remembers the failure. One
        # restarted whose agents do not answer yet says why its engine last exited, else why it was
        # placed again, before "unreachable".
        if phase == "Ready":
            last_error = None
        elif phase == "Starting" and seen.restarted:
            last_error = seen.engine_exit or last_error or agent_error
        else:
            last_error = agent_error or last_error
        if version is not None:
            entry["weightVersion"] = version
    elif count > max_restarts:
        entry["phase"] = "Failed"
        last_error = gave_up(count, last_error)
    elif seen.terminating:
        entry["phase"] = "Draining"
    else:
        entry["phase"] = "Pending"
    error = seen.unplaced or last_error
    if error:
        entry["lastError"] = error
    return entry


def gave_up(count: int, last_error: str | None) -> str:
    """The lastError of a shard given up on after ``count`` placements. ``last_error`` is the status's
    previous one, which already says so from the second reconcile on: it is kept, so an unchanged
    Failed shard keeps an equal status (and nothing is written)."""
    prefix = f"gave up after {count - 1} restarts; last: "
    if last_error is not None and last_error.startswith(prefix):
        return last_error
    return f"{prefix}{last_error}"


def observed(status: Object, fleet: desired.ParsedFleet, seen: FleetSeen, *, max_restarts: int, now: str) -> Object:
    """``status`` with the shards as observed: entries, counters, weight version and conditions."""
    refit: Object = status.get("refit") or {}
    current_version = None if refit.get("active") else refit.get("currentVersion")
    entries = [
        shard_entry(shard, seen.shard(shard), current_version=current_version, max_restarts=max_restarts)
        for shard in range(fleet.spec.replicas)
    ]
    ready = sum(1 for entry in entries if entry["phase"] == "Ready")
    versions = {entry.get("weightVersion") for entry in entries if entry["phase"] == "Ready"}
    updated = {
        **status,
        "observedGeneration": fleet.generation,
        "replicas": sum(1 for entry in entries if entry.get("pods")),
        "readyReplicas": ready,
        "shards": entries,
    }
    if len(versions) == 1 and None not in versions:
        updated["weightVersion"] = versions.pop()
    else:
        updated.pop("weightVersion", None)
    replicas, generation = fleet.spec.replicas, fleet.generation
    found = placed(list(updated.get("conditions", [])), seen.unplaced, replicas, generation=generation, now=now)
    found = readiness.ready_condition(found, ready, replicas, generation=generation, now=now)
    failing = failing_shards(entries, seen)
    found = readiness.degraded(found, ready, replicas, failing=failing, generation=generation, now=now)
    updated["conditions"] = readiness.weights_current(found, entries, refit, generation=generation, now=now)
    return updated


FAILING_PHASES = ("Pending", "Starting", "Loading", "Stale", "Failed")
"""The phases in which a shard that was restarted counts as failing (not Refitting: every shard
leaves Ready for a refit)."""


def failing_shards(entries: list[Object], seen: FleetSeen) -> list[str]:
    """One line per shard that is not ready after restarts (placed again, or its engine restarted by
    the kubelet), with its ``lastError``: what makes the fleet Degraded even when no shard serves."""
    return [
        f"shard {entry['index']}: {entry.get('lastError') or entry['phase']}"
        for entry in entries
        if entry["phase"] in FAILING_PHASES and seen.shard(entry["index"]).restarted
    ]


def engine_exits(before: Object, after: Object, seen: FleetSeen) -> list[str]:
    """The shards whose ``lastError`` turned into a new engine exit between the ``before`` and
    ``after`` status, one line each (for a Warning Event: the kubelet restarts a crashed engine in
    place, which no other step sees)."""
    previous = {item["index"]: item.get("lastError") for item in before.get("shards") or []}
    lines = []
    for entry in after.get("shards") or []:
        exited = seen.shard(entry["index"]).engine_exit
        if exited is not None and entry.get("lastError") == exited and previous.get(entry["index"]) != exited:
            lines.append(f"shard {entry['index']}: {exited}")
    return lines


def placed(
    found: list[conditions.Condition], unplaced: dict[int, str], replicas: int, *, generation: int, now: str
) -> list[conditions.Condition]:
    """Placed: every shard found nodes (else each reason, in shard order)."""
    if unplaced:
        message = "; ".join(unplaced[s] for s in sorted(unplaced))
        return conditions.set_condition(
            found,
            conditions.PLACED,
            conditions.Verdict(False, "Unschedulable", message),
            generation=generation,
            now=now,
        )
    return conditions.set_condition(
        found,
        conditions.PLACED,
        conditions.Verdict(True, "AllShardsPlaced", f"{replicas} shards placed"),
        generation=generation,
        now=now,
    )


def verify_addresses(
    status: Object, shards: pods.Shards, reports: pods.Reports, *, port: int, generation: int, now: str
) -> tuple[Object, str | None]:
    """EndpointsVerified: each frontend serves where its reserved Service sends traffic (pod 0's IP
    on the Service's target port); EndpointSlices cannot prove it here, they reject loopback IPs.
    Also returns the message of a mismatch that is new (for a Warning), else None."""
    reserved, served = [], []
    for shard in sorted(shards.pods):
        frontend = (reports.get(shard) or [None])[0]
        if frontend is None or frontend.served_address is None:
            continue
        reserved.append(f"shard {shard}: {shards.pods[shard][0].ip}:{port}")
        served.append(f"shard {shard}: {frontend.served_address}")
    before = conditions.find(status.get("conditions", []), conditions.ENDPOINTS_VERIFIED) or {}
    found = endpoints_verified(list(status.get("conditions", [])), reserved, served, generation=generation, now=now)
    after = conditions.find(found, conditions.ENDPOINTS_VERIFIED) or {}
    known = before.get("status") == "False" and before.get("reason") == "Mismatch"
    warning = after["message"] if after.get("reason") == "Mismatch" and not known else None
    return {**status, "conditions": found}, warning


def endpoints_verified(
    found: list[conditions.Condition], reserved: list[str], served: list[str], *, generation: int, now: str
) -> list[conditions.Condition]:
    """EndpointsVerified from the reserved and the served address of each answering frontend."""
    kind = conditions.ENDPOINTS_VERIFIED
    if not served:
        message = "no frontend reports an address yet"
        return conditions.set_condition(
            found, kind, conditions.Verdict(False, "NoFrontendServing", message), generation=generation, now=now
        )
    if reserved == served:
        message = f"{len(served)} frontends serve where their endpoints point"
        return conditions.set_condition(
            found, kind, conditions.Verdict(True, "Verified", message), generation=generation, now=now
        )
    message = f"reserved: {', '.join(reserved)}; served: {', '.join(served)}"
    return conditions.set_condition(
        found, kind, conditions.Verdict(False, "Mismatch", message), generation=generation, now=now
    )


def with_endpoints(
    status: Object, fleet: desired.ParsedFleet, endpoints: list[v1alpha1.Endpoint], *, now: str
) -> Object:
    """``status`` with the reserved endpoints, the pods' selector, EndpointsReserved and a valid spec."""
    found = conditions.set_condition(
        list(status.get("conditions", [])),
        conditions.ENDPOINTS_RESERVED,
        conditions.Verdict(True, "ServicesCreated", f"{len(endpoints)} frontend endpoints reserved"),
        generation=fleet.generation,
        now=now,
    )
    found = conditions.set_condition(
        found, conditions.INVALID_SPEC, conditions.Verdict(False, "Valid", ""), generation=fleet.generation, now=now
    )
    found = conditions.set_condition(
        found,
        conditions.NAME_CONFLICT,
        conditions.Verdict(False, "NoConflict", ""),
        generation=fleet.generation,
        now=now,
    )
    found = conditions.set_condition(
        found, conditions.STALLED, conditions.Verdict(False, "AsDesired", ""), generation=fleet.generation, now=now
    )
    return {
        **status,
        "endpoints": [endpoint.model_dump(mode="json", by_alias=True) for endpoint in endpoints],
        "selector": fleet.selector,
        "conditions": found,
    }


def invalid(status: Object, message: str, *, generation: int, now: str, kind: str = conditions.INVALID_SPEC) -> Object:
    """``status`` of a fleet that cannot be acted on: ``kind`` (InvalidSpec, or NameConflict when a
    derived name is taken) True, not Ready and Stalled (kstatus's word for it), all with ``message``."""
    found = conditions.set_condition(
        list(status.get("conditions", [])),
        kind,
        conditions.Verdict(True, kind, message),
        generation=generation,
        now=now,
    )
    found = conditions.set_condition(
        found, conditions.READY, conditions.Verdict(False, kind, message), generation=generation, now=now
    )
    found = conditions.set_condition(
        found, conditions.STALLED, conditions.Verdict(True, kind, message), generation=generation, now=now
    )
    return {**status, "conditions": found, "observedGeneration": generation}


async def write(api: kube.Api, body: Object, status: Object) -> None:
    """Merge-patch ``status`` into the fleet's, only when that changes it; ``body`` follows."""
    current = body.get("status") or {}
    if patches.unchanged(current, status):
        return
    metadata = body["metadata"]
    await api.patch_status("MegatronGeneration", metadata["name"], metadata["namespace"], status)
    body["status"] = {**current, **status}
