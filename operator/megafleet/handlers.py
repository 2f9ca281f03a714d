"""Kopf handlers: every trigger runs the same level-based :func:`megafleet.reconcile.reconcile`.

Imported by ``megafleet operator`` (:mod:`megafleet.operator_main`). Triggers: the fleet is created,
its spec changes, the operator resumes, any event of a pod the fleet owns (a pod whose fleet is
gone has its Kueue pod group ended: :func:`megafleet.reconcile.admission.release_orphan`), and the
observation daemon (:mod:`megafleet.reconcile.pacing`: a reconcile every few seconds while the fleet
changes, a slow agent probe once it is settled). Reconciles read pods, Services and nodes from Kopf indexes
(:mod:`megafleet.reconcile.cache`), which Kopf fills before it runs any handler. Refits are
advanced by :mod:`megafleet.refits.refit_controller` on create and a poll, and RefitSessions by
:mod:`megafleet.refits.session_controller` on create, resume and a poll. The polls are daemons that end once
their object is gone, so no fleet or Refit carries a finalizer (:mod:`megafleet.persistence`):
deleting one never waits for an operator. A RefitSession has one on purpose (Kopf's, for its delete
handler): its members leave the trainer's world and the fleet's hold is released before it goes.
The operator's runtime (clients, locks, delays, settings, cache) is made at startup and kept in
Kopf's ``memo`` as ``memo.runtime``; a per-fleet lock keeps reconciles and Refit steps of one fleet
sequential.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import kopf

from megafleet import agent_client, kube, metrics, names, persistence, reconcile
from megafleet import settings as operator_settings
from megafleet.api import v1alpha1
from megafleet.reconcile import admission, context, lost_nodes, pacing
from megafleet.reconcile import cache as watch_cache
from megafleet.refits import refit_controller, session_controller, session_status

log = logging.getLogger(__name__)

RESOURCE = (v1alpha1.GROUP, v1alpha1.VERSION, "megatrongenerations")
REFITS = (v1alpha1.GROUP, v1alpha1.VERSION, "refits")
SESSIONS = (v1alpha1.GROUP, v1alpha1.VERSION, "refitsessions")
SETTINGS = operator_settings.OperatorSettings.from_environ()
"""The operator's settings (defaults, with ``MEGAFLEET_<GROUP>_<FIELD>`` overrides); the decorators below
read their intervals at import."""
_TRIGGERS = SETTINGS.triggers


def diffbase_storage() -> persistence.DigestDiffBase:
    """Where Kopf keeps the last-handled configuration: digests, only for the operator's own kinds."""
    return persistence.DigestDiffBase(prefix=names.PREFIX, key="last-handled-configuration", group=v1alpha1.GROUP)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """``memo.clusterwide`` (set by :mod:`megafleet.operator_main`): the operator watches every namespace."""
    # Kopf's own bookkeeping goes to annotations under our prefix, never into our status contract.
    # Bounded and tolerant of malformed records; see megafleet.persistence.
    settings.persistence.progress_storage = persistence.TolerantProgress(prefix=names.PREFIX)
    settings.persistence.diffbase_storage = diffbase_storage()
    settings.posting.level = logging.INFO
    # One peering object for the whole cluster, even when this replica watches a few namespaces.
    settings.peering.clusterwide = True
    settings.peering.lifetime = _TRIGGERS.peering_lifetime_seconds
    settings.watching.server_timeout = 60
    agents = agent_client.AgentClient(timeout_seconds=SETTINGS.agents.timeout_seconds)
    cache = watch_cache.Cache(clusterwide=bool(memo.get("clusterwide", False)))
    memo.runtime = context.Runtime.of(kube.Api(), agents, SETTINGS, cache=cache)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await _runtime(memo).close()


def _runtime(memo: kopf.Memo, indexes: Mapping[str, Any] | None = None) -> context.Runtime:
    """The operator's runtime; ``indexes`` (a handler's keyword arguments) hand Kopf's indexes to its cache."""
    runtime = cast(context.Runtime, memo.runtime)
    if indexes is not None and runtime.cache is not None and not runtime.cache.ready:
        runtime.cache.attach(indexes)
    return runtime


def _delivered(memo: kopf.Memo, kind: str, type: str | None, body: kopf.Body) -> None:
    """Tell the cache what the watch delivered of an own pod or Service (:mod:`.reconcile.cache`)."""
    runtime = memo.get("runtime")
    if isinstance(runtime, context.Runtime) and runtime.cache is not None:
        if type == "DELETED":
            runtime.cache.forget(kind, body)
        else:
            runtime.cache.delivered(kind, body)


def _raw(body: kopf.Body) -> dict[str, Any]:
    """The object as the watch delivered it (Kopf's raw dicts; never changed in place)."""
    return dict(body)


# The index functions are coroutines: Kopf runs them in its event loop (a plain function would run in
# a thread), and fills every index of one event at once after they all ran.


@kopf.index(*RESOURCE, id=watch_cache.FLEETS)
async def megafleet_fleets(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    metadata = body["metadata"]
    return {(metadata.get("namespace") or "default", metadata["name"]): _raw(body)}


@kopf.index("v1", "pods", labels={names.LABEL_FLEET: kopf.PRESENT}, id=watch_cache.FLEET_PODS)
async def megafleet_fleet_pods(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    key = watch_cache.fleet_key(body)
    return {key: _raw(body)} if key is not None else {}


@kopf.index("v1", "services", labels={names.LABEL_FLEET: kopf.PRESENT}, id=watch_cache.FLEET_SERVICES)
async def megafleet_fleet_services(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    key = watch_cache.fleet_key(body)
    return {key: _raw(body)} if key is not None else {}


@kopf.index("v1", "pods", id=watch_cache.LIVE_PODS)
async def megafleet_live_pods(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    slim = watch_cache.slim_pod(body)
    return {None: slim} if slim is not None else {}


@kopf.index("v1", "nodes", id=watch_cache.NODES)
async def megafleet_nodes(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {body["metadata"]["name"]: watch_cache.slim_node(body)}  # by name: a node is looked up in one step


@kopf.on.event("v1", "services", labels={names.LABEL_FLEET: kopf.PRESENT})
async def on_service_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _delivered(memo, "Service", type, body)


async def _reconcile(
    runtime: context.Runtime, namespace: str, name: str, *, gather: float = 0.0, if_idle: bool = False
) -> bool:
    """One reconcile of the fleet; False when it is gone or going. A trigger that finds another
    reconcile of the fleet already waiting for its lock leaves the work to that one (it reads the
    fleet, and the cache Kopf updated before this trigger ran, once it holds the lock): a burst of
    pod events costs one reconcile, not one each. ``gather``: seconds the trigger waits before it
    takes the lock (pod events: their pods change in bursts, scheduled then started, and what
    arrives meanwhile is folded in), so a settling fleet is reconciled, and its status written, a
    few times, not once per pod event. ``if_idle``: a reconcile running now also does the work
    (the fleet's creation or resumption, and the observation daemon's pass, are not news to it):
    the creation trigger and the daemon's first pass, started together, cost one reconcile."""
    key = (namespace, name)
    lock = runtime.fleet_lock(namespace, name)
    if key in runtime.waiting or (if_idle and lock.locked()):
        metrics.RECONCILES.labels(outcome="coalesced").inc()
        return True
    runtime.waiting.add(key)
    try:
        if gather > 0:
            await asyncio.sleep(gather)
        await lock.acquire()
    finally:
        runtime.waiting.discard(key)
    try:
        fresh = await _fleet(runtime, namespace, name)
        if fresh is None or fresh["metadata"].get("deletionTimestamp"):
            metrics.forget_fleet(namespace, name)
            if runtime.cache is not None:
                runtime.cache.forget_fleet(namespace, name)
            return False

        def notify(kind: str, reason: str, message: str) -> None:
            kopf.event(kopf.Body(cast(kopf.RawBody, fresh)), type=kind, reason=reason, message=message)

        with metrics.RECONCILE_SECONDS.time():
            try:
                written = await reconcile.reconcile(runtime, fresh, notify=notify)
            except Exception:
                metrics.RECONCILES.labels(outcome="error").inc()
                raise
        metrics.RECONCILES.labels(outcome="ok").inc()
        replicas = int((fresh.get("spec") or {}).get("replicas", 1))
        metrics.record_fleet(namespace, name, replicas, written if written is not None else fresh.get("status") or {})
        return True
    finally:
        lock.release()


async def _fleet(runtime: context.Runtime, namespace: str, name: str) -> dict[str, Any] | None:
    """The fleet's latest state, not the event's: from the watch-fed cache, overlaid with the
    operator's own last write of it (:meth:`.reconcile.cache.Cache.fleet`), else read."""
    cached = runtime.cache.fleet(namespace, name) if runtime.cache is not None and runtime.cache.ready else None
    return cached if cached is not None else await runtime.api.get("MegatronGeneration", name, namespace)


async def poll(stopped: kopf.DaemonStopped, interval: float, step: Callable[[], Awaitable[bool]]) -> None:
    """Run ``step`` every ``interval`` seconds until it reports its object gone (or Kopf stops the
    daemon). A timer that ends by itself: these daemons hold no finalizer
    (:func:`megafleet.persistence.without_finalizers`), so Kopf does not stop them on deletion."""
    while not stopped and await step():
        await stopped.wait(interval)


@kopf.on.create(*RESOURCE, backoff=_TRIGGERS.retry_seconds)
@kopf.on.update(*RESOURCE, field="spec", backoff=_TRIGGERS.retry_seconds)
@kopf.on.resume(*RESOURCE, backoff=_TRIGGERS.retry_seconds)
async def on_fleet_change(namespace: str | None, name: str, reason: str, memo: kopf.Memo, **kwargs: Any) -> None:
    # A spec change waits for a reconcile in flight (it may have read the old spec); a creation or a
    # resumption is what a reconcile in flight (the daemon's first pass) already reads.
    idle_only = reason in (kopf.Reason.CREATE, kopf.Reason.RESUME)
    await _reconcile(_runtime(memo, kwargs), namespace or "default", name, if_idle=idle_only)


@kopf.daemon(*RESOURCE, backoff=_TRIGGERS.retry_seconds)
async def observe(
    namespace: str | None, name: str, body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **kwargs: Any
) -> None:
    runtime = _runtime(memo, kwargs)
    await pace(stopped, runtime, body, lambda: _reconcile(runtime, namespace or "default", name, if_idle=True))


async def pace(
    stopped: kopf.DaemonStopped, runtime: context.Runtime, body: Mapping[str, Any], step: Callable[[], Awaitable[bool]]
) -> None:
    """Observe one fleet until ``step`` (its reconcile) reports it gone: a reconcile every
    ``observe_interval_seconds`` while it is not settled (a probe instead while it is only
    starting, and a reconcile when that sees a change); once settled, agent probes with a growing
    delay, and a reconcile only when a probe sees a change (:mod:`megafleet.reconcile.pacing`).
    ``body`` is Kopf's live view of the fleet. A reconcile by any other trigger resets the delay."""
    metadata, triggers = body["metadata"], runtime.settings.triggers
    key = (metadata.get("namespace") or "default", metadata["name"])
    delay: float | None = None
    reconciled: context.Observation | None = None
    while not stopped:
        changed = reconciled is None or await pacing.probe(runtime, dict(body))
        if changed and not await step():
            return
        last = runtime.observed.get(key)
        if last is None or not last.settled:
            reconciled = last if last is not None and last.starting else None
            delay = None
            await stopped.wait(triggers.observe_interval_seconds)
            continue
        if last is not reconciled:  # a reconcile (this loop's or an event's) since the last probe
            reconciled, delay = last, None
        delay = pacing.next_delay(delay, first=triggers.probe_first_seconds, most=triggers.probe_most_seconds)
        await stopped.wait(delay)


@kopf.on.event("v1", "pods", labels={names.LABEL_FLEET: kopf.PRESENT})
async def on_pod_event(
    type: str | None, body: kopf.Body, namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **kwargs: Any
) -> None:
    _delivered(memo, "Pod", type, body)
    runtime = _runtime(memo, kwargs)
    namespace, fleet = namespace or "default", labels[names.LABEL_FLEET]
    if type != "DELETED" and pacing.pod_unchanged(runtime, namespace, fleet, _raw(body)):
        metrics.RECONCILES.labels(outcome="unchanged").inc()
        return
    gather = runtime.settings.triggers.pod_event_gather_seconds
    if not await _reconcile(runtime, namespace, fleet, gather=gather) and type != "DELETED":
        await admission.release_orphan(runtime.api, _raw(body))  # Kueue's finalizer would hold it


def _deleted(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


@kopf.on.event("v1", "nodes", when=_deleted)  # the filter: no handler call (nor log line) per heartbeat
async def on_node_event(name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    """A deleted node: reconcile at once every fleet with a pod on it (Kopf took the node out of the
    index first), which releases its shards (:mod:`megafleet.reconcile.lost_nodes`). A node that turns
    unreachable is lost only once the pods' toleration runs out: the probes of the fleets notice."""
    runtime = _runtime(memo, kwargs)
    for namespace, fleet in lost_nodes.fleets_on(runtime.cache, name):
        await _reconcile(runtime, namespace, fleet)


def _unfinished(status: Mapping[str, Any], **_: Any) -> bool:
    return status.get("phase") not in ("Succeeded", "Failed")


async def _advance_refit(runtime: context.Runtime, namespace: str, name: str, fleet: str) -> str | None:
    """One step of the Refit; the phase it was in before the step, None when it is gone or finished."""
    async with runtime.fleet_lock(namespace, fleet):  # never beside the fleet's reconcile
        # Read under the lock: a trigger that waited for it must see what the one before it wrote
        # (two triggers starting the same attempt would each tell the agents to join).
        body = await runtime.api.get("Refit", name, namespace)
        status = (body or {}).get("status") or {}
        if body is None or not _unfinished(status):
            return None
        await refit_controller.advance(runtime, body)
        return str(status.get("phase") or "Pending")


@kopf.on.create(*REFITS, backoff=_TRIGGERS.retry_seconds)
@kopf.on.resume(*REFITS, backoff=_TRIGGERS.retry_seconds, when=_unfinished)
async def on_refit(namespace: str | None, name: str, spec: Mapping[str, Any], memo: kopf.Memo, **_: Any) -> None:
    await _advance_refit(_runtime(memo), namespace or "default", name, spec["fleetRef"]["name"])


@kopf.daemon(*REFITS, backoff=_TRIGGERS.retry_seconds, when=_unfinished)
async def poll_refit(
    namespace: str | None, name: str, spec: Mapping[str, Any], memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    runtime, fleet = _runtime(memo), spec["fleetRef"]["name"]
    while not stopped:  # a timer that ends by itself, as poll(): faster while the Refit runs
        phase = await _advance_refit(runtime, namespace or "default", name, fleet)
        if phase is None:
            return
        await stopped.wait(SETTINGS.refit.next_poll_seconds(phase))


def _session_open(status: Mapping[str, Any], **_: Any) -> bool:
    return status.get("phase") not in session_status.ENDED


async def _advance_session(runtime: context.Runtime, namespace: str, name: str, fleet: str) -> bool:
    """One step of the RefitSession; False when it is gone, going or ended. A phase change is an
    Event on the session (a Warning when it ends)."""
    async with runtime.fleet_lock(namespace, fleet):  # beside the fleet's reconcile and its Refits
        session = await runtime.api.get("RefitSession", name, namespace)
        if session is None or session["metadata"].get("deletionTimestamp"):
            return False
        if not _session_open(session.get("status") or {}):
            return False
        await session_controller.advance(runtime, session)
        after = await runtime.api.get("RefitSession", name, namespace)
    before = (session.get("status") or {}).get("phase", "Pending")
    status = (after or {}).get("status") or {}
    if after is not None and status.get("phase", "Pending") != before:
        kind = "Warning" if status["phase"] in session_status.ENDED else "Normal"
        message = status.get("message") or status["phase"]
        kopf.event(kopf.Body(cast(kopf.RawBody, after)), type=kind, reason=f"Session{status['phase']}", message=message)
    return after is not None and _session_open(status)


@kopf.on.create(*SESSIONS, backoff=_TRIGGERS.retry_seconds)
@kopf.on.resume(*SESSIONS, backoff=_TRIGGERS.retry_seconds, when=_session_open)
async def on_session(namespace: str | None, name: str, spec: Mapping[str, Any], memo: kopf.Memo, **_: Any) -> None:
    await _advance_session(_runtime(memo), namespace or "default", name, spec["fleetRef"]["name"])


@kopf.daemon(*SESSIONS, backoff=_TRIGGERS.retry_seconds, when=_session_open)
async def poll_session(
    namespace: str | None, name: str, spec: Mapping[str, Any], memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    runtime, fleet = _runtime(memo), spec["fleetRef"]["name"]
    await poll(
        stopped, SETTINGS.session.poll_seconds, lambda: _advance_session(runtime, namespace or "default", name, fleet)
    )


persistence.without_finalizers(kopf.get_default_registry())  # after every daemon above is registered


@kopf.on.delete(*SESSIONS, backoff=_TRIGGERS.retry_seconds)
async def on_session_delete(
    namespace: str | None, name: str, spec: Mapping[str, Any], memo: kopf.Memo, **_: Any
) -> None:
    """The finalizer's work: the members leave the trainer's world, the fleet's hold is released."""
    runtime = _runtime(memo)
    namespace = namespace or "default"
    async with runtime.fleet_lock(namespace, spec["fleetRef"]["name"]):
        await session_controller.release(runtime, namespace, name)
