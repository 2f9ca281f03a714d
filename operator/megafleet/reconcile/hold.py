"""The hold a RefitSession puts on its fleet: what waits while a trainer's world is held.

While ``status.refit.session`` names a session, the fleet's shards are members of a trainer's
world that cannot grow, shrink or be rebuilt (NeMo RL builds its collective once per run): the
reconcile (:func:`megafleet.reconcile.reconcile`) then scales, rolls, places and catches up
nothing, and heals broken shards only (by then the world is lost anyway). The condition
``RefitSessionHeld`` says which changes wait. Pure except :func:`verify`; called by the reconcile and
by :mod:`megafleet.session_driver` when it takes or releases the hold.
"""

from __future__ import annotations

from megafleet import conditions, desired
from megafleet.reconcile import context, pods

HELD = "Held"
RELEASED = "Released"
ENDED = ("Broken", "Closed", "Failed")
"""RefitSession phases that never hold a fleet (the session driver releases the hold as it ends one)."""


async def verify(ctx: context.FleetContext) -> None:
    """Drop a hold whose session is gone or ended (its finalizer removed by hand, an operator that
    stopped between two writes): a fleet is never held by nothing. The caller writes the status."""
    session = ctx.held
    if session is None:
        return
    found = await ctx.api.get("RefitSession", session, ctx.fleet.namespace)
    if found is not None and (found.get("status") or {}).get("phase", "Pending") not in ENDED:
        return
    ctx.status = {**ctx.status, "refit": {**ctx.refit, "session": None}}
    ctx.notify("Warning", "RefitSessionReleased", f"RefitSession {session} is gone or ended: the hold is released")


def waiting(fleet: desired.ParsedFleet, shards: pods.Shards) -> list[str]:
    """The changes of the spec the hold keeps from being applied (empty: none yet)."""
    replicas = fleet.spec.replicas
    present = set(shards.pods) | shards.terminating
    found = []
    if any(shard >= replicas for shard in present) or any(shard not in present for shard in range(replicas)):
        found.append(f"spec.replicas {replicas}")
    current = desired.template_hash(fleet)
    if any(pod.template_hash != current for members in shards.pods.values() for pod in members):
        found.append("a pod template change")
    return found


def held(
    found: list[conditions.Condition], session: str, changes: list[str], *, generation: int, now: str
) -> list[conditions.Condition]:
    """RefitSessionHeld=True, naming the session and the changes that wait for it."""
    if changes:
        verb = "waits" if len(changes) == 1 else "wait"
        message = f"{' and '.join(changes)} {verb} until RefitSession {session} ends"
    else:
        message = f"scaling and template rolls wait until RefitSession {session} ends"
    return conditions.set_condition(
        found, conditions.REFIT_SESSION_HELD, True, HELD, message, generation=generation, now=now
    )


def released(found: list[conditions.Condition], *, generation: int, now: str) -> list[conditions.Condition]:
    """RefitSessionHeld=False once no session holds the fleet (left out if it never was held)."""
    if conditions.find(found, conditions.REFIT_SESSION_HELD) is None:
        return found
    return conditions.set_condition(
        found, conditions.REFIT_SESSION_HELD, False, RELEASED, "", generation=generation, now=now
    )
