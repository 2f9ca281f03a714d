"""A RefitSession's status: its checks, phases and conditions, as pure functions under table tests.

Called by the RefitSession controller's steps (:mod:`.session_controller`, :mod:`.session_end`,
:mod:`.refit_info_check`), and by the Refit controller for the reasons a session ends with. Each
function returns the status update of one step (merged into the session's status by
:func:`.session_view.write`), or a verdict the step acts on.
"""

from __future__ import annotations

from megafleet import conditions, desired, planner
from megafleet.api import v1alpha1
from megafleet.fleet_state import hold
from megafleet.objects import Object
from megafleet.refits import refit_status, session_view
from megafleet_protocol import agent_api

JOINED = "Joined"
"""Condition: every member joined the trainer's world (False, with the reason, once it ends)."""
REFIT_INFO_ACCEPTED = "RefitInfoAccepted"
"""Condition: ``spec.refitInfo`` was read and matches its sha256 and count."""
BROKEN = "Broken"
"""Condition: the held world was lost (reason MemberLost, RefitFailed or RefitInfoRejected)."""

WORLD_SIZE_MISMATCH = "WorldSizeMismatch"
BACKEND_NOT_SUPPORTED = "BackendNotSupported"
NOT_READY = "NotReady"
JOIN_FAILED = "JoinFailed"
MEMBER_LOST = "MemberLost"
REFIT_FAILED = "RefitFailed"
REFIT_INFO_REJECTED = "RefitInfoRejected"
TRAINER_GONE = "TrainerGone"

ENDED = hold.ENDED
"""Phases a session never leaves."""


def check(spec: v1alpha1.RefitSessionSpec, fleet: desired.ParsedFleet) -> tuple[str, str] | None:
    """Why the fleet can never field the trainer's inference world, as (reason, message), or None.

    Every shard has the same ``S`` = TP x PP x CP ranks, so the fleet fields ``spec.replicas x S``
    ranks, and they must be exactly ``worldSize - trainerWorldSize``; megatronNative needs the
    megatron backend (megatron-core's own receiving side)."""
    world = spec.world
    if spec.megatron_native is not None and fleet.spec.engine.backend != "megatron":
        return BACKEND_NOT_SUPPORTED, (
            f"megatronNative needs engine.backend megatron (megatron-core receives the swap); fleet {fleet.name} "
            f"runs {fleet.spec.engine.backend}: use nemoCollective"
        )
    shard_size = fleet.layout.pods_per_shard * fleet.layout.ranks_per_pod
    members = spec.member_shards(fleet.spec.replicas)
    outside = [shard for shard in members if shard >= fleet.spec.replicas]
    if outside:
        return WORLD_SIZE_MISMATCH, (
            f"the trainer's membership names shards {outside}, but fleet {fleet.name} has {fleet.spec.replicas}"
        )
    fleet_ranks, wanted = len(members) * shard_size, world.world_size - world.trainer_world_size
    if fleet_ranks != wanted:
        fielded = f"{fleet.spec.replicas} shards" if spec.shards is None else f"{len(members)} member shards"
        return WORLD_SIZE_MISMATCH, (
            f"the trainer's inference world is {wanted} ranks (worldSize {world.world_size} - trainerWorldSize "
            f"{world.trainer_world_size}); fleet {fleet.name} has {fielded} x {shard_size} ranks "
            f"= {fleet_ranks}"
        )
    return None


def without_fleet(phase: str, fleet: str, exists: bool) -> tuple[str, str | None, str]:
    """What a session in ``phase`` does when its fleet is gone (``exists`` False) or its spec does
    not parse, as (phase, reason, message): Pending waits (no reason); Joining fails, JoinFailed;
    Joined breaks, MemberLost."""
    if phase == "Pending":
        return "Pending", None, f"fleet {fleet} does not exist" if not exists else f"fleet {fleet} has an invalid spec"
    message = f"fleet {fleet} is gone or invalid"
    if phase == "Joining":
        return "Failed", JOIN_FAILED, message
    return "Broken", MEMBER_LOST, message


def joining(session: session_view.Session, membership: planner.Membership, shards: int) -> Object:
    """The update that starts the join: the membership, published once and never recomputed."""
    world = session.spec.world
    first, last = world.trainer_world_size, membership.world_size - 1
    return {
        "phase": "Joining",
        "membership": refit_status.membership(membership),
        "message": f"{shards} shards join {session.world_address} as ranks {first}..{last} of {world.world_size}",
    }


def joined(session: session_view.Session, worlds: tuple[agent_api.NemoWorldStatus, ...], now: str) -> Object:
    """The update once every member reported the world joined: Joined=True, and the generation of
    NeMo's world that the members report (the first one that reports any)."""
    world = session.spec.world
    ranks = world.world_size - world.trainer_world_size
    message = f"{ranks} fleet ranks joined the trainer's world at {session.world_address} ({world.world_size} ranks)"
    found = conditions.set_condition(
        session.conditions,
        JOINED,
        conditions.Verdict(True, "AllMembersJoined", message),
        generation=session.generation,
        now=now,
    )
    update: Object = {"phase": "Joined", "message": message, "conditions": found}
    generation = next((found.generation for found in worlds if found.generation is not None), None)
    if generation is not None:
        update["generation"] = generation
    return update


def ended(session: session_view.Session, phase: str, reason: str, message: str, now: str) -> Object:
    """The update that ends a session in ``phase`` (Failed, Broken or Closed) for ``reason``:
    Joined=False, and Broken=True for a broken one."""
    generation = session.generation
    found = conditions.set_condition(
        session.conditions, JOINED, conditions.Verdict(False, reason, message), generation=generation, now=now
    )
    if phase == "Broken":
        found = conditions.set_condition(
            found, BROKEN, conditions.Verdict(True, reason, message), generation=generation, now=now
        )
    return {"phase": phase, "message": message, "conditions": found}


def refit_info_waiting(session: session_view.Session, why: str, now: str) -> Object:
    """RefitInfoAccepted=False, Waiting: the trainer has not written its refit info yet."""
    found = conditions.set_condition(
        session.conditions,
        REFIT_INFO_ACCEPTED,
        conditions.Verdict(False, "Waiting", why),
        generation=session.generation,
        now=now,
    )
    return {"conditions": found}


def refit_info_accepted(session: session_view.Session, tensors: int, now: str) -> Object:
    """RefitInfoAccepted=True, Checked, with the count and the start of the sha256 (of the collective's
    refit info, or of NeMo's reshard refit info)."""
    reshard = session.spec.nemo_reshard
    ref = session.spec.refit_info or (reshard.refit_info if reshard is not None else None)
    message = f"{tensors} tensors, sha256 {ref.sha256[:12]}…" if ref is not None else ""
    found = conditions.set_condition(
        session.conditions,
        REFIT_INFO_ACCEPTED,
        conditions.Verdict(True, "Checked", message),
        generation=session.generation,
        now=now,
    )
    return {"conditions": found}


def store_unreachable(worlds: tuple[agent_api.NemoWorldStatus, ...], member_pods: int) -> bool:
    """Every one of the ``member_pods`` reported, and each found the trainer's store unreachable (a
    pod that did not answer this time, or that does not know, does not count as unreachable)."""
    return len(worlds) == member_pods and all(world.store_reachable is False for world in worlds)
