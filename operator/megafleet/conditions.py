"""Condition types, reasons and the one helper that sets a condition (Kubernetes conventions).

A condition's ``lastTransitionTime`` changes only when its status changes, so re-computing the
same state yields the same list and the reconcile writes nothing.
"""

from __future__ import annotations

import datetime
from typing import Any, NamedTuple

ENDPOINTS_RESERVED = "EndpointsReserved"
PLACED = "Placed"
READY = "Ready"
WEIGHTS_CURRENT = "WeightsCurrent"
ENDPOINTS_VERIFIED = "EndpointsVerified"
DEGRADED = "Degraded"
INVALID_SPEC = "InvalidSpec"
NAME_CONFLICT = "NameConflict"
RECONCILING = "Reconciling"
"""kstatus's abnormal-true condition: True while the operator still brings the shards to the spec
(placing, scaling in, rolling a changed template), so GitOps health checks wait for it."""
STALLED = "Stalled"
"""kstatus's abnormal-true condition for a fleet the operator cannot act on until a person changes
something (InvalidSpec, NameConflict): GitOps health checks fail at once instead of timing out."""
REFIT_SESSION_HELD = "RefitSessionHeld"
"""A RefitSession holds the fleet's shards in a trainer's world (:mod:`megafleet.fleet_state.hold`)."""
ADMITTED = "Admitted"
"""Kueue admitted every shard of a fleet with ``gang.scheduler: Kueue`` (:mod:`megafleet.reconcile.admission`)."""

Condition = dict[str, Any]


def now() -> str:
    """A condition or status timestamp: UTC, whole seconds, RFC 3339."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Verdict(NamedTuple):
    """What a condition says: its status, a CamelCase reason and a message for people."""

    status: bool
    reason: str
    message: str


def set_condition(
    conditions: list[Condition], kind: str, verdict: Verdict, *, generation: int, now: str
) -> list[Condition]:
    """A copy of ``conditions`` with ``kind`` set to ``verdict``, stamped with the object's
    ``generation`` and, when its status changes, ``now``; other conditions are kept as they are."""
    status, reason, message = verdict
    value = "True" if status else "False"
    previous = next((c for c in conditions if c.get("type") == kind), None)
    changed = previous is None or previous.get("status") != value
    updated: Condition = {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed or previous is None else previous.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }
    if previous is None:
        return [*conditions, updated]
    return [updated if c.get("type") == kind else c for c in conditions]  # keep the order stable


def find(conditions: list[Condition], kind: str) -> Condition | None:
    return next((c for c in conditions if c.get("type") == kind), None)
