"""The Refit controller: membership from live shards, every agent told to receive, progress collected.

Called by the Kopf handlers for Refit objects (:mod:`megafleet.handlers`) on create and by a 1 s
timer while the refit runs, under the fleet's lock. Level-based like the fleet reconcile: the
Refit's status says where it stands (Pending -> Running -> Succeeded | Failed) and each call
advances it by one step over a :class:`~megafleet.refits.context.RefitContext`. The fleet's
``status.refit.active`` is the lock (:mod:`.fleet_lock`): one refit per fleet at a time, and the
fleet's reconcile does not scale while it is set. On success the fleet's
``status.refit.currentVersion`` moves on; shards not at it afterwards are Stale (see
:mod:`megafleet.reconcile.fencing`).

Admission first: a spec that does not parse (only an object admitted by an older CRD) ends
``Failed``, ``InvalidSpec``; a Refit whose fleet is gone or invalid ends ``Failed``. Versions never
go backwards: a Pending Refit whose version is not above the fleet's current one ends ``Failed``,
``VersionNotNewer``, before anything is sent to an agent; while a RefitSession holds the fleet,
rendezvous and checkpoint Refits are refused (``SessionHeld``); a Refit waits while another holds
the fleet. Then one step of an attempt (:mod:`.attempts`), or the single attempt of a Refit through
a RefitSession (:mod:`.session_refits`).

Readiness after a refit comes from the Refit's own completion: the status patch that moves
``status.refit.currentVersion`` also marks each member shard whose agents reported the new version
``Ready`` at it, with ``readyReplicas`` and the Ready, Degraded and WeightsCurrent conditions
(:func:`.refit_status.settled_status`), so a client reading the fleet's status (any process's
:class:`megafleet.sdk.fleet.Fleet`, ``kubectl wait``) sees it at once, not at the reconcile's next
pass. Pruning (:func:`.refit_status.prunable`) deletes only finished Refits, never the newest one.
"""

from __future__ import annotations

import pydantic

from megafleet.api import v1alpha1
from megafleet.fleet_state import pods, token
from megafleet.objects import Object
from megafleet.reconcile import context as reconcile_context
from megafleet.refits import attempts, context, fleet_lock, refit_status, session_refits


async def advance(runtime: reconcile_context.Runtime, body: Object) -> None:
    """Move one Refit forward by one step (idempotent)."""
    if (body.get("status") or {}).get("phase", "Pending") in refit_status.FINISHED:
        return
    ctx = await _admit(runtime, body)
    if ctx is None or await _refused(ctx) or await _waiting(ctx):
        return
    ctx.token = await token.read(ctx.api, ctx.fleet)
    ctx.pods = await pods.whole_running(ctx.api, ctx.fleet, held=ctx.through_session)
    if ctx.phase != "Pending":
        await attempts.collect(ctx)
    elif ctx.through_session:
        await session_refits.start(ctx)
    else:
        await attempts.start(ctx)


async def _admit(runtime: reconcile_context.Runtime, body: Object) -> context.RefitContext | None:
    """The Refit's context once its spec and its fleet's parse; else None, the Refit finished Failed."""
    api = runtime.api
    try:  # admission checks the same: only an object admitted by an older CRD fails here
        spec = v1alpha1.RefitObjectSpec.model_validate(body["spec"])
    except pydantic.ValidationError as error:
        reasons = "; ".join(f"spec.{'.'.join(map(str, item['loc']))}: {item['msg']}" for item in error.errors())
        await fleet_lock.finish(
            api, body, None, refit_status.failed(f"invalid spec: {reasons}", refit_status.INVALID_SPEC)
        )
        return None
    fleet_name = spec.fleet_ref.name
    fleet_body = await api.get("MegatronGeneration", fleet_name, body["metadata"]["namespace"])
    if fleet_body is None:
        await fleet_lock.finish(api, body, None, refit_status.failed(f"fleet {fleet_name} does not exist"))
        return None
    fleet = context.parse_fleet(fleet_body)
    if fleet is None:
        await fleet_lock.finish(api, body, fleet_body, refit_status.failed(f"fleet {fleet_name} has an invalid spec"))
        return None
    return context.RefitContext(runtime, body, spec, fleet_body, fleet)


async def _refused(ctx: context.RefitContext) -> bool:
    """A Pending Refit that may not run ends now (:func:`.refit_status.refused`)."""
    if ctx.phase != "Pending":
        return False
    outcome = refit_status.refused(ctx.spec, ctx.fleet_body.get("status") or {})
    if outcome is None:
        return False
    await fleet_lock.finish(ctx.api, ctx.body, None, outcome)
    return True


async def _waiting(ctx: context.RefitContext) -> bool:
    """Another Refit holds the fleet: this one waits, Pending."""
    active = ctx.fleet_refit.get("active")
    if active in (None, ctx.name):
        return False
    await ctx.write({"phase": "Pending", "message": f"waiting for refit {active}"})
    return True
