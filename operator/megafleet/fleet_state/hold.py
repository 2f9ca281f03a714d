"""The hold a RefitSession puts on its fleet: what waits while a trainer's world is held, and for what.

While ``status.refit.session`` names a session, the fleet's shards in its world (``spec.shards``,
NeMo's refit membership, else the members it published at its join) are ranks of a trainer's
communicator that only the trainer can rebuild (NeMo RL rebuilds it at a training step's refit, with
``set_refit_membership`` and ``rebuild_collective``: a new session). So the reconcile
(:func:`megafleet.reconcile.reconcile`) rolls nothing and loads no checkpoint into a shard while held,
heals broken shards, and scales at the trainer's rebuilds:

* a scale-out's new shards (and a lost shard outside the world) are placed at once, outside the
  world: they stay Stale until the trainer's next rebuild names them (NeMo's fleet-health monitor
  learns of them, :mod:`megafleet.sdk.nemo.fleet_health`) and a refit after it makes them current;
* a scale-in's shards that are in the world keep serving its refits until a rebuild's membership
  leaves them out (the monitor is told they retire), then they are removed; those outside it are
  removed at once.

So a held scale waits at most until the trainer's next rebuild, which NeMo RL does before the refit of
its next training step. The condition ``RefitSessionHeld`` says what waits and for what
(:func:`waiting`). The RefitSession controller takes the hold (:func:`take`) as its session starts to
join and releases it (:func:`release`) as the session ends; the reconcile reads the holding session's
world (:func:`world`), drops a hold whose session is gone, and keeps the condition.
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
    ``replicas``: its ``spec.shards`` (NeMo's refit membership), else the members it published at its
    join (a scale since does not change them), else every shard (before the join); ``None`` when the
    session is gone or ended (its finalizer removed by hand, an operator that stopped between two
    writes): a fleet is never held by nothing."""
    found = await api.get("RefitSession", session, namespace)
    status = (found or {}).get("status") or {}
    if found is None or status.get("phase", "Pending") in ENDED:
        return None
    shards = (found.get("spec") or {}).get("shards")
    if shards is None:
        published = (status.get("membership") or {}).get("rankOffsets")
        shards = [entry["shard"] for entry in published] if published else range(replicas)
    return sorted(int(shard) for shard in shards)


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


def unapplied(fleet: desired.ParsedFleet, shards: pods.Shards) -> list[str]:
    """The changes of the spec not applied to the shards yet, held or not (empty: none): the
    Reconciling condition's (:func:`megafleet.fleet_state.readiness.reconciling`)."""
    replicas = fleet.spec.replicas
    present = set(shards.pods) | shards.terminating
    found = []
    if any(shard >= replicas for shard in present) or any(shard not in present for shard in range(replicas)):
        found.append(f"spec.replicas {replicas}")
    current = desired.template_hash(fleet)
    if any(pod.template_hash != current for members in shards.pods.values() for pod in members):
        found.append("a pod template change")
    return found


def waiting(fleet: desired.ParsedFleet, shards: pods.Shards, members: frozenset[int]) -> list[str]:
    """What the hold keeps from being applied, each saying for what (empty: nothing), with ``members``
    the shards in the holding session's world: the shards of ``spec.replicas`` outside it (added by a
    scale-out, or lost) join at the trainer's next rebuild, those above it still in it leave at that
    rebuild, and a pod template change waits until the session ends."""
    replicas = fleet.spec.replicas
    found = []
    joining = [shard for shard in range(replicas) if shard not in members]
    leaving = sorted(shard for shard in members if shard >= replicas and shard in shards.pods)
    if joining:
        found.append(f"spec.replicas {replicas}: {_shards(joining)} join{_s(joining)} at the trainer's next rebuild")
    if leaving:
        them = "it" if len(leaving) == 1 else "them"
        found.append(
            f"spec.replicas {replicas}: {_shards(leaving)} leave{_s(leaving)} at the trainer's next rebuild "
            f"(its world still names {them})"
        )
    current = desired.template_hash(fleet)
    if any(pod.template_hash != current for members_ in shards.pods.values() for pod in members_):
        found.append("a pod template change waits until it ends")
    return found


def _shards(indices: list[int]) -> str:
    return f"shard {indices[0]}" if len(indices) == 1 else "shards " + ", ".join(str(i) for i in indices)


def _s(indices: list[int]) -> str:
    return "s" if len(indices) == 1 else ""


def held(
    found: list[conditions.Condition], session: str, changes: list[str], *, generation: int, now: str
) -> list[conditions.Condition]:
    """RefitSessionHeld=True, naming the session and what waits for it (:func:`waiting`)."""
    if changes:
        message = f"RefitSession {session} holds the fleet: " + "; ".join(changes)
    else:
        message = f"template rolls wait until RefitSession {session} ends; scaling applies at its trainer's rebuilds"
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
