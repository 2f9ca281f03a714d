"""The hold a RefitSession puts on its fleet: what waits while a trainer's world is held.

While ``status.refit.session`` names a session, the fleet's shards are members of a trainer's
world that cannot grow, shrink or be rebuilt (NeMo RL builds its collective once per run): the
reconcile (:func:`megafleet.reconcile.reconcile`) then scales, rolls, places and catches up
nothing, and heals broken shards only (by then the world is lost anyway); a lost shard outside the
world (a session of NeMo's refit membership, ``spec.shards``, leaves it out) is placed again, so that
it is there, Stale, when the trainer's next rebuild names it. The condition
``RefitSessionHeld`` says which changes wait. The RefitSession controller takes the hold
(:func:`take`) as its session starts to join and releases it (:func:`release`) as the session ends;
the reconcile reads the holding session's world (:func:`world`), drops a hold whose session is gone,
and keeps the condition.
Pure except those three.
"""

from __future__ import annotations

from megafleet import conditions, desired, kube
from megafleet.fleet_state import pods
from megafleet.objects import Object

HELD = "Held"
RELEASED = "Released"
ENDED = ("Broken", "Closed", "Failed")
"""RefitSession phases that never hold a fleet (the RefitSession controller releases the hold as it
ends one)."""


async def world(api: kube.Api, namespace: str, session: str, replicas: int) -> list[int] | None:
    """The shards in the trainer's world of the RefitSession ``session`` that holds a fleet of
    ``replicas`` (its ``spec.shards``, NeMo's refit membership, else every shard), or ``None`` when the
    session is gone or ended (its finalizer removed by hand, an operator that stopped between two
    writes): a fleet is never held by nothing."""
    found = await api.get("RefitSession", session, namespace)
    if found is None or (found.get("status") or {}).get("phase", "Pending") in ENDED:
        return None
    shards = (found.get("spec") or {}).get("shards")
    return sorted(int(shard) for shard in shards) if shards is not None else list(range(replicas))


async def take(api: kube.Api, fleet_body: Object, session: str) -> None:
    """Take the fleet's hold for ``session``: ``status.refit.session`` and RefitSessionHeld."""
    status = fleet_body.get("status") or {}
    refit = {**(status.get("refit") or {}), "session": session}
    generation = int(fleet_body["metadata"].get("generation", 1))
    found = held(list(status.get("conditions") or []), session, [], generation=generation, now=conditions.now())
    metadata = fleet_body["metadata"]
    await api.patch_status(
        "MegatronGeneration", metadata["name"], metadata["namespace"], {"refit": refit, "conditions": found}
    )


async def release(api: kube.Api, fleet_body: Object, session: str) -> None:
    """Release the fleet's hold if ``session`` has it (else nothing is written)."""
    refit = dict((fleet_body.get("status") or {}).get("refit") or {})
    if refit.get("session") != session:
        return
    refit["session"] = None
    metadata = fleet_body["metadata"]
    found = released(
        list((fleet_body.get("status") or {}).get("conditions") or []),
        generation=int(metadata.get("generation", 1)),
        now=conditions.now(),
    )
    await api.patch_status(
        "MegatronGeneration", metadata["name"], metadata["namespace"], {"refit": refit, "conditions": found}
    )


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
        found, conditions.REFIT_SESSION_HELD, conditions.Verdict(True, HELD, message), generation=generation, now=now
    )


def released(found: list[conditions.Condition], *, generation: int, now: str) -> list[conditions.Condition]:
    """RefitSessionHeld=False once no session holds the fleet (left out if it never was held)."""
    if conditions.find(found, conditions.REFIT_SESSION_HELD) is None:
        return found
    return conditions.set_condition(
        found, conditions.REFIT_SESSION_HELD, conditions.Verdict(False, RELEASED, ""), generation=generation, now=now
    )
