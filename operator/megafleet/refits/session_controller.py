"""The RefitSession controller: a trainer's own weight-transfer world that the fleet's shards join
once (at NeMo RL's ``init_collective``) and hold for the run's refits.

Called by the Kopf handlers for RefitSession objects (:mod:`megafleet.handlers`) on create, resume
and a 1 s timer (:func:`advance`), and on delete, the session's finalizer (:func:`release`). Always
under the fleet's lock, beside the fleet's reconcile. Level-based: the session's ``status.phase``
says where it stands and each call advances it by one step over a
:class:`~megafleet.refits.context.SessionContext`:

* ``Pending``: checks (:func:`.session_status.check`: ``WorldSizeMismatch``, ``BackendNotSupported``
  end it ``Failed``), then waits until no other session or Refit holds the fleet and every shard
  runs with an answering agent (``loading`` counts: a join needs no weights), at most
  ``joinTimeoutSeconds`` after creation (then ``Failed``, ``NotReady``). Then it takes the hold
  (the fleet's ``status.refit.session`` and condition ``RefitSessionHeld``,
  :func:`megafleet.fleet_state.hold.take`), publishes the membership
  (:func:`megafleet.planner.rank_offsets`, decided once, never recomputed) and asks every member
  pod's agent to join (``POST /v1/refit/nemo/join`` or ``/v1/refit/megatron/join``).
* ``Joining``: every member pod reports ``world.phase`` ``joined`` → ``Joined``; a refusal, a
  failed join, a lost pod or the deadline → ``Failed``, ``JoinFailed`` naming the pod (never retried:
  the trainer's store has already counted or timed out its clients).
* ``Joined``: the refit info is checked once (:mod:`.refit_info_check`, or NeMo's reshard refit info,
  :mod:`.reshard_info_check`); with ``spec.nemoReshard`` the members join the stage communicators
  beside the world (:mod:`.session_reshard`, condition ``ReshardJoined``); a member gone, failed,
  restarted or out of the world → ``Broken``, ``MemberLost`` naming shard and pod; every member
  reporting the trainer's store unreachable for ``trainer_gone_seconds`` → ``Closed``,
  ``TrainerGone``. While a Refit through the session runs, the Refit controller owns the outcome.

Every end (:func:`.session_end.end`) tells the members to leave and releases the hold, so healing
and the held spec changes run again. Agents know a session by its UID: a new session of the same
name is another world.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

from megafleet import conditions, planner
from megafleet.fleet_state import hold, pods, token
from megafleet.objects import Object
from megafleet.reconcile import context as reconcile_context
from megafleet.refits import (
    context,
    members,
    refit_info_check,
    reshard_info_check,
    session_end,
    session_reshard,
    session_status,
    session_view,
)
from megafleet_protocol import agent_api

log = logging.getLogger(__name__)


async def advance(
    runtime: reconcile_context.Runtime,
    body: Object,
    *,
    now: Callable[[], datetime.datetime] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Move one RefitSession forward by one step (idempotent). ``now`` (wall time, for the join
    deadline) and ``clock`` (monotonic, for the trainer-gone wait) are replaced by tests."""
    session = session_view.Session.parse(body)
    if session.phase in session_status.ENDED:
        return
    at = (now or session_view.utcnow)()
    fleet_body = await runtime.api.get("MegatronGeneration", session.spec.fleet_ref.name, session.namespace)
    fleet = context.parse_fleet(fleet_body)
    if fleet is None or fleet_body is None:
        await _without_fleet(runtime, session, exists=fleet_body is not None)
        return
    ctx = context.SessionContext(runtime, session, fleet_body, fleet, at=at, monotonic=clock())
    if session.phase == "Pending":
        await _pending(ctx)
    elif session.phase == "Joining":
        await _joining(ctx)
    else:
        await _joined(ctx)


async def release(runtime: reconcile_context.Runtime, namespace: str, name: str) -> None:
    """The finalizer's work on delete: the members leave the trainer's world, the fleet's hold is
    released (:func:`.session_end.release`). The caller holds the fleet's lock."""
    runtime.store_lost.pop((namespace, name), None)
    found = await runtime.api.get("RefitSession", name, namespace)  # still there: the finalizer holds it
    if found is not None:
        await session_end.release(runtime.api, runtime.agents, session_view.Session.parse(found))


async def _without_fleet(runtime: reconcile_context.Runtime, session: session_view.Session, *, exists: bool) -> None:
    phase, reason, message = session_status.without_fleet(session.phase, session.spec.fleet_ref.name, exists)
    if reason is None:
        await session_view.write(runtime.api, session, {"phase": phase, "message": message})
    else:
        await session_end.end(runtime.api, runtime.agents, session, phase=phase, reason=reason, message=message)


async def _end(ctx: context.SessionContext, phase: str, reason: str, message: str) -> None:
    await session_end.end(ctx.api, ctx.agents, ctx.session, phase=phase, reason=reason, message=message)


# -- Pending -----------------------------------------------------------------------------------


async def _pending(ctx: context.SessionContext) -> None:
    problem = session_status.check(ctx.session.spec, ctx.fleet)
    if problem is not None:
        await _end(ctx, "Failed", *problem)
        return
    ctx.token = await token.read(ctx.api, ctx.fleet)
    waiting = await _waiting(ctx)
    if waiting is None:
        await _take_and_join(ctx)
    elif ctx.at >= ctx.session.deadline:
        message = f"{waiting} for joinTimeoutSeconds {ctx.session.spec.join_timeout_seconds}"
        await _end(ctx, "Failed", session_status.NOT_READY, message)
    else:
        await ctx.write({"phase": "Pending", "message": waiting})


async def _waiting(ctx: context.SessionContext) -> str | None:
    """What the join waits for: another session's hold, a running Refit, or the members
    (:func:`.members.not_ready`, which reads ``ctx.pods``); None when nothing."""
    refit = ctx.fleet_refit
    if refit.get("session") not in (None, ctx.session.name):
        return f"waiting for RefitSession {refit['session']}"
    if refit.get("active") is not None:
        return f"waiting for Refit {refit['active']}"
    ctx.pods = await pods.whole_running(ctx.api, ctx.fleet)
    return await members.not_ready(ctx)


async def _take_and_join(ctx: context.SessionContext) -> None:
    """Hold the fleet, publish the membership, and ask every member pod to join."""
    world, fleet = ctx.session.spec.world, ctx.fleet
    shard_size = fleet.layout.pods_per_shard * fleet.layout.ranks_per_pod
    shards = ctx.session.spec.member_shards(fleet.spec.replicas)  # NeMo's packing: ascending, no gaps
    membership = planner.rank_offsets(world.trainer_world_size, shards, shard_size)
    await hold.take(ctx.api, ctx.fleet_body, ctx.session.name)
    await ctx.write(session_status.joining(ctx.session, membership, len(shards)))
    left = max(1, int((ctx.session.deadline - ctx.at).total_seconds()))
    for shard, offset in sorted(membership.offsets.items()):
        for pod in ctx.pods[shard]:
            error = await ctx.agents.join(pod.ip, ctx.token, _join_body(ctx.session, offset, left))
            if error is not None:
                message = f"shard {shard}, pod {pod.name} refused the join: {error}"
                await _end(ctx, "Failed", session_status.JOIN_FAILED, message)
                return
    log.info("RefitSession %s/%s: %d shards asked to join", ctx.session.namespace, ctx.session.name, len(shards))


def _join_body(
    session: session_view.Session, offset: int, timeout_seconds: int
) -> agent_api.NemoJoinRequest | agent_api.MegatronJoinRequest:
    world = session.spec.world
    rendezvous = agent_api.RendezvousBody(
        address=world.address,
        port=world.port,
        world_size=world.world_size,
        rank_offset=offset,
        trainer_world_size=world.trainer_world_size,
    )
    if session.spec.nemo_collective is not None:
        return agent_api.NemoJoinRequest(
            session=session.key,
            rendezvous=rendezvous,
            generation=session.spec.nemo_collective.generation,
            timeout_seconds=timeout_seconds,
        )
    assert session.spec.megatron_native is not None  # the model validator guarantees one protocol
    return agent_api.MegatronJoinRequest(
        session=session.key,
        rendezvous=rendezvous,
        copy_backend=session.spec.megatron_native.copy_backend,
        timeout_seconds=timeout_seconds,
    )


# -- Joining and Joined -------------------------------------------------------------------------


async def _joining(ctx: context.SessionContext) -> None:
    ctx.token = await token.read(ctx.api, ctx.fleet)
    found = await members.report(ctx)
    if found.lost is not None:
        await _end(ctx, "Failed", session_status.JOIN_FAILED, found.lost)
        return
    if found.joining is None:
        update = session_status.joined(ctx.session, found.worlds, conditions.now())
        await ctx.write(update)
        log.info("RefitSession %s/%s joined: %s", ctx.session.namespace, ctx.session.name, update["message"])
        return
    grace = datetime.timedelta(seconds=ctx.settings.session.join_grace_seconds)
    if ctx.at >= ctx.session.deadline + grace:
        timeout = ctx.session.spec.join_timeout_seconds
        await _end(
            ctx,
            "Failed",
            session_status.JOIN_FAILED,
            f"not joined within joinTimeoutSeconds {timeout}: {found.joining}",
        )


async def _joined(ctx: context.SessionContext) -> None:
    if ctx.fleet_refit.get("active") is not None:
        return  # a Refit through this session runs: the Refit controller decides how it ends
    accepted = conditions.find(ctx.session.conditions, session_status.REFIT_INFO_ACCEPTED) or {}
    spec, checked = ctx.session.spec, accepted.get("status") == "True"
    if not checked and spec.refit_info is not None and not await refit_info_check.accept(ctx):
        return  # the session ended on it
    reshard_info = spec.nemo_reshard.refit_info if spec.nemo_reshard is not None else None
    if not checked and reshard_info is not None and not await reshard_info_check.accept(ctx):
        return
    ctx.token = await token.read(ctx.api, ctx.fleet)
    found = await members.report(ctx)
    key = (ctx.session.namespace, ctx.session.name)
    if found.lost is not None:
        ctx.runtime.store_lost.pop(key, None)
        await _end(ctx, "Broken", session_status.MEMBER_LOST, found.lost)
        return
    if spec.nemo_reshard is not None and not await session_reshard.advance(ctx, found.worlds):
        ctx.runtime.store_lost.pop(key, None)
        return  # the stages' join failed, or a member lost its stages
    await _watch_the_trainer(ctx, found.worlds)


async def _watch_the_trainer(ctx: context.SessionContext, worlds: tuple[agent_api.NemoWorldStatus, ...]) -> None:
    """Close the session once every member has found the trainer's store unreachable for
    ``trainer_gone_seconds`` (one member reaching it restarts the wait)."""
    key = (ctx.session.namespace, ctx.session.name)
    member_pods = len(ctx.session.members) * ctx.fleet.layout.pods_per_shard
    if not session_status.store_unreachable(worlds, member_pods):
        ctx.runtime.store_lost.pop(key, None)
        return
    since = ctx.runtime.store_lost.setdefault(key, ctx.monotonic)
    waited = ctx.settings.session.trainer_gone_seconds
    if ctx.monotonic - since >= waited:
        ctx.runtime.store_lost.pop(key, None)
        message = (
            f"every member has found the trainer's store at {ctx.session.world_address} unreachable for {waited:g} s: "
            "the trainer is gone"
        )
        await _end(ctx, "Closed", session_status.TRAINER_GONE, message)
