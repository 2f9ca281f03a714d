"""Reconcile one MegatronGeneration: a short sequence of steps over one :class:`~context.FleetContext`.

Called by the Kopf handlers (:mod:`megafleet.handlers`) on create, update, resume, a timer and
events of the fleet's pods, one reconcile per fleet at a time. Level-based and idempotent: each
step reads what exists, compares it with the spec and writes only the difference, so a reconcile
with nothing to change makes no API writes. Endpoints are reserved, and published in status and the
ConfigMap, before any pod exists. While a refit runs, nothing is scaled, rolled or placed; while a
RefitSession holds the fleet (:mod:`megafleet.fleet_state.hold`), nothing is rolled or caught up,
broken shards are still healed, and scaling goes on around the trainer's world: new shards are placed
outside it, and its members above ``spec.replicas`` leave once a rebuild leaves them out.

Steps, each in the module named for it: :mod:`.validate`, :mod:`.endpoints`,
:mod:`megafleet.fleet_state.pods` (observe; :mod:`.admission` reads what Kueue decided for a fleet
that uses it), :mod:`.shards` (scale down, heal, roll, place; :mod:`.lost_nodes` releases shards on
lost nodes after healing), :mod:`.fencing`, :mod:`.catch_up`, :mod:`.status`.
Pods, Services and nodes are read from the watch-fed :mod:`.cache` when the operator runs one.
An object under a derived name that the fleet does not own stops the sequence
(:mod:`megafleet.fleet_state.ownership`): NameConflict, nothing adopted or published.
"""

from __future__ import annotations

from typing import Any

from megafleet import conditions
from megafleet.fleet_state import hold, ownership, pods, readiness
from megafleet.reconcile import (
    admission,
    catch_up,
    context,
    endpoints,
    fencing,
    lost_nodes,
    pacing,
    shards,
    status,
    validate,
)

__all__ = ["reconcile"]


async def reconcile(
    runtime: context.Runtime, body: dict[str, Any], *, notify: context.Notify = context.ignore
) -> dict[str, Any] | None:
    """Bring the objects and status of one fleet in line with its spec; returns the status the
    sequence ended with (``None`` for an invalid spec), which the handlers' metrics read. What it
    saw is kept for the observation daemon's probes (:mod:`.pacing`) only when every step ran."""
    metadata = body["metadata"]
    runtime.observed.pop((metadata.get("namespace") or "default", metadata["name"]), None)
    fleet = await validate.fleet(runtime.api, body, notify, checked=runtime.checked_pods)
    if fleet is None:
        return None
    ctx = context.FleetContext(runtime, body, fleet, notify, status=dict(body.get("status") or {}))
    try:
        await _steps(ctx)
    except ownership.NameConflict as conflict:
        await _report_conflict(ctx, str(conflict))
    return ctx.status


async def _steps(ctx: context.FleetContext) -> None:
    ctx.token = await endpoints.agent_token(ctx)
    await _verify_hold(ctx)
    await endpoints.reserve(ctx)
    await status.write(ctx.api, ctx.body, ctx.status)  # published before any pod is created
    ctx.shards = await pods.observe(ctx.api, ctx.fleet, ctx.runtime.cache)
    await admission.observe(ctx)  # before healing: a shard Kueue preempted is no restart
    held = None if ctx.held is None else ctx.held_world
    if not ctx.refitting:  # a held world's members above spec.replicas leave at the trainer's rebuild
        await shards.scale_down(ctx, keep=held or frozenset())
    await shards.heal(ctx)
    await lost_nodes.release(ctx)
    if not ctx.refitting and held is None:
        await shards.roll(ctx)
    if not ctx.refitting:  # while held, outside the world: Stale until the trainer's next rebuild names them
        await shards.place(ctx, outside=held)
    ctx.reports = await pods.ask_agents(ctx.agents, ctx.shards, ctx.token)
    await fencing.fence(ctx)
    if ctx.held is None:  # a checkpoint load would drop the members' place in the trainer's world
        await catch_up.start(ctx)
    await _write_observed(ctx)
    pacing.record(ctx)


async def _verify_hold(ctx: context.FleetContext) -> None:
    """Read the holding session's world into ``ctx.held_world``; drop a hold whose session is gone or
    ended: a fleet is never held by nothing. The caller writes the status."""
    session = ctx.held
    if session is None:
        return
    members = await hold.world(ctx.api, ctx.fleet.namespace, session, ctx.fleet.spec.replicas)
    if members is not None:
        ctx.held_world = frozenset(members)
        return
    ctx.status = {**ctx.status, "refit": {**ctx.refit, "session": None}}
    ctx.notify("Warning", "RefitSessionReleased", f"RefitSession {session} is gone or ended: the hold is released")


async def _report_conflict(ctx: context.FleetContext, message: str) -> None:
    """NameConflict=True naming the object, and a Warning Event when it is new; nothing else."""
    current: dict[str, Any] = dict(ctx.body.get("status") or {})
    before = conditions.find(current.get("conditions", []), conditions.NAME_CONFLICT) or {}
    kind, generation = conditions.NAME_CONFLICT, ctx.fleet.generation
    await status.write(
        ctx.api, ctx.body, status.invalid(current, message, generation=generation, now=conditions.now(), kind=kind)
    )
    if before.get("status") != "True" or before.get("message") != message:
        ctx.notify("Warning", conditions.NAME_CONFLICT, message)


async def _write_observed(ctx: context.FleetContext) -> None:
    """Status as observed, with the frontends' served addresses checked against the endpoints."""
    now = conditions.now()
    seen = status.FleetSeen(ctx.shards, ctx.unplaced, ctx.restarts, ctx.reports)
    observed = status.observed(ctx.status, ctx.fleet, seen, max_restarts=ctx.settings.shards.max_restarts, now=now)
    exits = status.engine_exits(ctx.status, observed, seen)
    if exits:  # the kubelet restarted an engine in place: no other step sees it
        ctx.notify("Warning", "EngineExited", context.summary(exits))
    port, generation = ctx.fleet.spec.frontend.port, ctx.fleet.generation
    ctx.status, mismatch = status.verify_addresses(
        observed, ctx.shards, ctx.reports, port=port, generation=generation, now=now
    )
    found = list(ctx.status.get("conditions", []))
    if ctx.held is not None:
        changes = hold.waiting(ctx.fleet, ctx.shards, ctx.held_world)
        found = hold.held(found, ctx.held, changes, generation=generation, now=now)
    else:
        found = hold.released(found, generation=generation, now=now)
    found = readiness.reconciling(found, hold.unapplied(ctx.fleet, ctx.shards), generation=generation, now=now)
    found = admission.condition(ctx, found, now=now)
    ctx.status = {**ctx.status, "conditions": found}
    if mismatch is not None:
        ctx.notify("Warning", "EndpointsMismatch", mismatch)
    await status.write(ctx.api, ctx.body, ctx.status)
