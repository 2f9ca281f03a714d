"""Kopf handlers: every trigger runs the same level-based :func:`megafleet.reconcile.reconcile`.

Imported by ``megafleet operator`` (:mod:`megafleet.operator_main`). Triggers: the fleet is created,
its spec changes, the operator resumes, a periodic timer (observation), and any event of a pod
the fleet owns. A per-fleet lock keeps reconciles of one fleet sequential.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf

from megafleet import agent_client, kube, metrics, names, reconcile, refit_driver
from megafleet.api import v1alpha1

log = logging.getLogger(__name__)

RESOURCE = (v1alpha1.GROUP, v1alpha1.VERSION, "megatrongenerations")
OBSERVE_INTERVAL_SECONDS = 5.0
"""How often every fleet is observed even when nothing announces a change."""
PEERING_LIFETIME_SECONDS = 20
"""How long a silent replica still counts as alive; a standby takes over after that."""
RETRY_SECONDS = 5.0
"""Delay before a failed reconcile is retried (Kopf's default of 60 s is too slow for fleets)."""

_locks: dict[tuple[str, str], asyncio.Lock] = {}
_api: kube.Api | None = None
_agents: agent_client.AgentClient | None = None


def _clients() -> tuple[kube.Api, agent_client.AgentClient]:
    global _api, _agents
    if _api is None or _agents is None:
        _api, _agents = kube.Api(), agent_client.AgentClient()
    return _api, _agents


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Kopf's own bookkeeping goes to annotations under our prefix, never into our status contract.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    # One peering object for the whole cluster, even when this replica watches a few namespaces.
    settings.peering.clusterwide = True
    settings.peering.lifetime = PEERING_LIFETIME_SECONDS
    settings.watching.server_timeout = 60


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if _api is not None:
        await _api.close()
    if _agents is not None:
        await _agents.close()


async def _reconcile(namespace: str, name: str) -> None:
    api, agents = _clients()
    lock = _locks.setdefault((namespace, name), asyncio.Lock())
    async with lock:
        fresh = await api.get("MegatronGeneration", name, namespace)  # the latest state, not the event's
        if fresh is None or fresh["metadata"].get("deletionTimestamp"):
            return

        def notify(kind: str, reason: str, message: str) -> None:
            kopf.event(kopf.Body(cast(kopf.RawBody, fresh)), type=kind, reason=reason, message=message)

        with metrics.RECONCILE_SECONDS.time():
            try:
                await reconcile.reconcile(api, agents, fresh, notify=notify)
            except Exception:
                metrics.RECONCILES.labels(outcome="error").inc()
                raise
        metrics.RECONCILES.labels(outcome="ok").inc()


@kopf.on.create(*RESOURCE, backoff=RETRY_SECONDS)
@kopf.on.update(*RESOURCE, field="spec", backoff=RETRY_SECONDS)
@kopf.on.resume(*RESOURCE, backoff=RETRY_SECONDS)
async def on_fleet_change(namespace: str | None, name: str, **_: Any) -> None:
    await _reconcile(namespace or "default", name)


@kopf.timer(*RESOURCE, interval=OBSERVE_INTERVAL_SECONDS, sharp=False, backoff=RETRY_SECONDS)
async def observe(namespace: str | None, name: str, **_: Any) -> None:
    await _reconcile(namespace or "default", name)


@kopf.on.event("v1", "pods", labels={names.LABEL_FLEET: kopf.PRESENT})
async def on_pod_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    await _reconcile(namespace or "default", labels[names.LABEL_FLEET])


REFITS = (v1alpha1.GROUP, v1alpha1.VERSION, "refits")
REFIT_POLL_SECONDS = 1.0
"""How often a running refit's agents are asked for progress."""


def _unfinished(status: Mapping[str, Any], **_: Any) -> bool:
    return status.get("phase") not in ("Succeeded", "Failed")


async def _advance_refit(namespace: str, name: str, fleet: str) -> None:
    api, agents = _clients()
    async with _locks.setdefault((namespace, fleet), asyncio.Lock()):  # never beside the fleet's reconcile
        # Read under the lock: a trigger that waited for it must see what the one before it wrote
        # (two triggers starting the same attempt would each tell the agents to join).
        refit = await api.get("Refit", name, namespace)
        if refit is not None:
            await refit_driver.advance(api, agents, refit)


@kopf.on.create(*REFITS, backoff=RETRY_SECONDS)
@kopf.on.resume(*REFITS, backoff=RETRY_SECONDS, when=_unfinished)
async def on_refit(namespace: str | None, name: str, spec: Mapping[str, Any], **_: Any) -> None:
    await _advance_refit(namespace or "default", name, spec["fleetRef"]["name"])


@kopf.timer(*REFITS, interval=REFIT_POLL_SECONDS, sharp=False, backoff=RETRY_SECONDS, when=_unfinished)
async def poll_refit(namespace: str | None, name: str, spec: Mapping[str, Any], **_: Any) -> None:
    await _advance_refit(namespace or "default", name, spec["fleetRef"]["name"])
