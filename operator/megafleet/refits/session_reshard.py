"""The stage communicators of NeMo RL's M-to-N reshard in a RefitSession: the members join every
training pipeline stage's communicator beside the session's NeMo world once it is joined (NeMo calls
``init_nccl_reshard_comm_group`` after ``init_collective``), and hold them for the session's Refits.

Called by the RefitSession controller's Joined step (:mod:`.session_controller`) for a session with
``spec.nemoReshard``, each tick; the condition ``ReshardJoined`` says where it stands:

* absent: every member pod is asked to join (``POST /v1/refit/nemo/reshard/join``; shard ``i`` is rank
  ``trainerRanksPerStage + prefix`` in every stage, its prefix being its offset in NeMo's world less the
  trainer's ranks, as NeMo counts its inference ranks); ReshardJoined=False, ``Joining``. A refusal ends
  the session Failed, ``JoinFailed`` (the trainer's stage stores have already counted or timed out).
* False, ``Joining``: every member pod reports ``world.reshard`` joined → True, ``AllMembersJoined``; one
  failed or left, or ``joinTimeoutSeconds`` (from when they were asked) plus the grace passed →
  Failed, ``JoinFailed``.
* True: a member that no longer holds its stages → Broken, ``MemberLost``.

The verdicts are pure functions (:func:`verdict`, :func:`asked`, :func:`joined`) under table tests.
"""

from __future__ import annotations

import datetime
import logging
from typing import Literal

from megafleet import conditions
from megafleet.fleet_state import pods
from megafleet.objects import Object
from megafleet.refits import context, session_end, session_status, session_view
from megafleet_protocol import agent_api

log = logging.getLogger(__name__)

RESHARD_JOINED = "ReshardJoined"
"""Condition: every member joined every stage communicator of ``spec.nemoReshard``."""
JOINING = "Joining"
ALL_MEMBERS_JOINED = "AllMembersJoined"

Verdict = Literal["joined", "joining", "lost"]


def stage_offset(session: session_view.Session, offset: int) -> int:
    """A member shard's first rank in every stage communicator, from its ``offset`` in NeMo's world."""
    reshard, world = session.spec.nemo_reshard, session.spec.world
    assert reshard is not None
    return reshard.trainer_ranks_per_stage + offset - world.trainer_world_size


def join_body(session: session_view.Session, offset: int, timeout_seconds: int) -> agent_api.NemoReshardJoinRequest:
    """What a member shard's pods are sent (the same for every pod of the shard: each rank adds its own)."""
    reshard = session.spec.nemo_reshard
    assert reshard is not None
    return agent_api.NemoReshardJoinRequest(
        session=session.key,
        stages=[agent_api.NemoReshardStage(address=stage.address, port=stage.port) for stage in reshard.stages],
        trainer_ranks_per_stage=reshard.trainer_ranks_per_stage,
        sub_world_size=reshard.sub_world_size,
        rank_offset=stage_offset(session, offset),
        timeout_seconds=timeout_seconds,
    )


def verdict(worlds: tuple[agent_api.NemoWorldStatus, ...], member_pods: int) -> tuple[Verdict, str]:
    """Where the members' stages stand, with what to say: ``lost`` (one failed or left; the first,
    with its error), ``joined`` (every one of ``member_pods`` reported them joined), else ``joining``
    (one still joins, or did not answer this time)."""
    waiting = ""
    for world in worlds:
        stages = world.reshard
        if stages is None:
            waiting = waiting or f"rank {world.rank} has not been asked to join the stages"
            continue
        if stages.phase in ("failed", "left"):
            why = stages.error or ("it left them" if stages.phase == "left" else "its join failed")
            return "lost", f"rank {world.rank} (stage rank {stages.rank}) lost its stage communicators: {why}"
        if stages.phase == "joining":
            waiting = waiting or f"rank {world.rank} is still joining the stage communicators"
    if waiting or len(worlds) < member_pods:
        return "joining", waiting or f"{member_pods - len(worlds)} member pods did not answer"
    return "joined", f"{member_pods} member pods joined the stage communicators"


def asked(session: session_view.Session, shards: int, now: str) -> Object:
    """ReshardJoined=False, Joining: the members were asked to join (its time starts the join's deadline)."""
    reshard = session.spec.nemo_reshard
    assert reshard is not None
    message = (
        f"{shards} shards join {len(reshard.stages)} stage communicators of {reshard.sub_world_size} ranks "
        f"({reshard.trainer_ranks_per_stage} trainer ranks each)"
    )
    return _condition(session, conditions.Verdict(False, JOINING, message), now)


def joined(session: session_view.Session, message: str, now: str) -> Object:
    """ReshardJoined=True, AllMembersJoined."""
    return _condition(session, conditions.Verdict(True, ALL_MEMBERS_JOINED, message), now)


def _condition(session: session_view.Session, found: conditions.Verdict, now: str) -> Object:
    return {
        "conditions": conditions.set_condition(
            session.conditions, RESHARD_JOINED, found, generation=session.generation, now=now
        )
    }


def not_joined(session: session_view.Session) -> str | None:
    """Why a Refit cannot go through ``session``'s reshard yet (its stages are not joined), or None
    (also for a session without ``nemoReshard``)."""
    if session.spec.nemo_reshard is None:
        return None
    stages = conditions.find(session.conditions, RESHARD_JOINED) or {}
    if stages.get("status") == "True":
        return None
    return (
        f"RefitSession {session.name}'s stage communicators are not joined ({stages.get('message') or 'not asked yet'})"
    )


async def advance(ctx: context.SessionContext, worlds: tuple[agent_api.NemoWorldStatus, ...]) -> bool:
    """One step of the stages' join for a Joined session with ``spec.nemoReshard`` (the members'
    ``worlds`` as reported this tick); False once the session ended on it."""
    session = ctx.session
    found = conditions.find(session.conditions, RESHARD_JOINED)
    if found is None:
        return await _ask(ctx)
    member_pods = len(session.members) * ctx.fleet.layout.pods_per_shard
    state, message = verdict(worlds, member_pods)
    if found.get("status") == "True":
        if state == "lost":
            await _end(ctx, "Broken", session_status.MEMBER_LOST, message)
            return False
        return True
    if state == "lost":
        await _end(ctx, "Failed", session_status.JOIN_FAILED, message)
        return False
    if state == "joined":
        await ctx.write(joined(session, message, _stamp(ctx.at)))
        log.info("RefitSession %s/%s: %s", session.namespace, session.name, message)
        return True
    since = _time(found.get("lastTransitionTime")) or ctx.at
    deadline = since + datetime.timedelta(
        seconds=session.spec.join_timeout_seconds + ctx.settings.session.join_grace_seconds
    )
    if ctx.at >= deadline:
        timeout = session.spec.join_timeout_seconds
        await _end(ctx, "Failed", session_status.JOIN_FAILED, f"stages not joined within {timeout} s: {message}")
        return False
    return True


async def _ask(ctx: context.SessionContext) -> bool:
    session = ctx.session
    timeout = session.spec.join_timeout_seconds
    ctx.pods = await pods.whole_running(ctx.api, ctx.fleet, held=True)
    for shard, offset in session.members:
        for pod in ctx.pods.get(shard, []):
            error = await ctx.agents.join(pod.ip, ctx.token, join_body(session, offset, timeout))
            if error is not None:
                message = f"shard {shard}, pod {pod.name} refused to join the stage communicators: {error}"
                await _end(ctx, "Failed", session_status.JOIN_FAILED, message)
                return False
    await ctx.write(asked(session, len(session.members), _stamp(ctx.at)))  # the join's deadline counts from it
    shards = len(session.members)
    log.info("RefitSession %s/%s: %d shards asked to join the stages", session.namespace, session.name, shards)
    return True


async def _end(ctx: context.SessionContext, phase: str, reason: str, message: str) -> None:
    await session_end.end(ctx.api, ctx.agents, ctx.session, phase=phase, reason=reason, message=message)


def _stamp(at: datetime.datetime) -> str:
    return at.strftime(_FORMAT)


def _time(text: object) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    return datetime.datetime.strptime(text, _FORMAT).replace(tzinfo=datetime.UTC)


_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
"""A condition's time, as :func:`megafleet.conditions.now` writes it."""
