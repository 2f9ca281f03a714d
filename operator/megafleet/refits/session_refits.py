"""The one attempt of a Refit through a RefitSession (``source.session``, NeMo RL's own collective).

Called by the Refit controller (:mod:`.refit_controller`) for a Pending Refit that names a session;
its progress is collected like any attempt's (:func:`.attempts.collect`). The session's membership
and held world are used as they are (never recomputed), every member pod is told to receive
(``POST /v1/refit/nemo``, ``/v1/refit/nemo/reshard`` for a session with NeMo's M-to-N reshard, or
``/v1/refit/megatron``, in the session form), and there is exactly one
attempt: a trainer's broadcast cannot be replayed, so a failure breaks the session. A Refit through
a session that is not ``Joined`` (or not this fleet's, or whose reshard stages are not joined) fails
``SessionNotJoined``; a NeMo session without usable refit info fails ``RefitInfoMissing``. Its modes
are resolved against the members' capabilities as any attempt's (:func:`.modes.resolve`);
megatron-core's own swap never stages.
"""

from __future__ import annotations

from typing import Any

from megafleet import conditions
from megafleet.api import v1alpha1
from megafleet.refits import (
    attempts,
    context,
    fleet_lock,
    modes,
    refit_info_check,
    refit_status,
    reshard_info_check,
    session_reshard,
    session_view,
)
from megafleet_protocol import agent_api


async def start(ctx: context.RefitContext) -> None:
    """Start the one attempt: the session's membership published as the Refit's (and the fleet's
    lock), then every member pod told to receive."""
    assert ctx.spec.source.session is not None
    session = await session_view.load(ctx.api, ctx.namespace, ctx.spec.source.session.name)
    refused = not_joined(session, ctx.spec)
    if refused is not None or session is None:
        await fleet_lock.finish(
            ctx.api, ctx.body, None, refit_status.failed(refused or "", refit_status.SESSION_NOT_JOINED)
        )
        return
    info: list[agent_api.NemoTensor] | dict[str, Any] = []
    if session.spec.nemo_collective is not None:
        try:
            if session.spec.nemo_reshard is not None:
                info = await reshard_info_check.read(ctx.api, session)
            else:
                info = await refit_info_check.read(ctx.api, session)
        except refit_info_check.RefitInfoError as error:
            message = f"RefitSession {session.name} has no usable refitInfo: {error}"
            await fleet_lock.finish(
                ctx.api, ctx.body, None, refit_status.failed(message, refit_status.REFIT_INFO_MISSING)
            )
            return
    members = [shard for shard, _ in session.members]
    await _capabilities(ctx, members)
    native_swap = session.spec.megatron_native is not None
    chosen = modes.resolve(ctx.fleet.spec, ctx.spec, ctx.capabilities, native_swap=native_swap)
    if await attempts.staging_unavailable(ctx, chosen):
        return
    membership = session.status.membership
    assert membership is not None  # published before the session could join
    published = membership.model_dump(mode="json", by_alias=True)
    await fleet_lock.take(ctx, published)
    running = {
        "phase": "Running",
        "membership": published,
        "attempts": 1,
        "startTime": conditions.now(),
        "message": f"{len(session.members)} shards receive version {ctx.spec.version} through RefitSession "
        f"{session.name}",
        **attempts.started(ctx, chosen),
    }
    await ctx.write(running)
    body = _request(ctx, session, info, chosen)
    ctx.body = {**ctx.body, "status": {**ctx.status, **running}}
    for shard in members:
        if shard not in ctx.pods:
            await attempts.fail(ctx, members, f"shard {shard} of RefitSession {session.name} has no running pods")
            return
        for pod in ctx.pods[shard]:
            refusal = await ctx.agents.refit_start(pod.ip, ctx.token, body)
            if refusal is not None:
                await attempts.fail(ctx, members, f"{pod.name} refused: {refusal}")
                return


async def _capabilities(ctx: context.RefitContext, members: list[int]) -> None:
    """What the running pods of the member shards can do across a refit, into ``ctx.capabilities``
    (an agent that does not answer now adds nothing: the refit finds it gone when it starts)."""
    for shard in members:
        pods = ctx.pods.get(shard, [])
        for pod, state in zip(pods, await ctx.agents.states([pod.ip for pod in pods], ctx.token), strict=True):
            if state.error is None:
                ctx.capabilities.append(modes.MemberCapabilities(shard, pod.name, state.capabilities))


def not_joined(session: session_view.Session | None, spec: v1alpha1.RefitObjectSpec) -> str | None:
    """Why a Refit cannot go through its session (it does not exist, serves another fleet, or its
    world is not joined), or None."""
    assert spec.source.session is not None
    named = spec.source.session.name
    if session is None:
        return f"RefitSession {named} does not exist"
    if session.spec.fleet_ref.name != spec.fleet_ref.name:
        return f"RefitSession {named} holds fleet {session.spec.fleet_ref.name}, not {spec.fleet_ref.name}"
    if session.phase != "Joined":
        detail = f": {session.status.message}" if session.status.message else ""
        return f"RefitSession {named} is {session.phase}, not Joined{detail}"
    return session_reshard.not_joined(session)


def _request(
    ctx: context.RefitContext,
    session: session_view.Session,
    info: list[agent_api.NemoTensor] | dict[str, Any],
    chosen: modes.Modes,
) -> agent_api.NemoRefitRequest | agent_api.MegatronRefitRequest | agent_api.NemoReshardRefitRequest:
    """The body every member pod gets: the same for all (each rank knows its place in the world)."""
    version, timeout, fields = ctx.spec.version, ctx.fleet.spec.refit.timeout_seconds, modes.request_fields(chosen)
    nemo = session.spec.nemo_collective
    if nemo is None:
        return agent_api.MegatronRefitRequest(version=version, timeout_seconds=timeout, session=session.key, **fields)
    if isinstance(info, dict):  # NeMo's M-to-N reshard: the bulk over the stages, the rest over the world
        return agent_api.NemoReshardRefitRequest(
            version=version,
            timeout_seconds=timeout,
            **fields,
            session=session.key,
            refit_info=info,
            bucket_bytes=nemo.bucket_bytes,
        )
    return agent_api.NemoRefitRequest(
        version=version,
        timeout_seconds=timeout,
        **fields,
        session=session.key,
        refit_info=info,
        bucket_bytes=nemo.bucket_bytes,
        generation=session.status.generation or nemo.generation,
    )
