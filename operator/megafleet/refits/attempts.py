"""One attempt of a Refit: its members told to receive, their progress collected, a failure retried
or given up.

Called by the Refit controller (:mod:`.refit_controller`): :func:`start` for a Pending rendezvous
or checkpoint Refit (a Refit through a RefitSession starts in :mod:`.session_refits`),
:func:`collect` for a Running one of either kind, :func:`fail` when a member refuses or fails.

The refit protocol (docs/refit-protocol.md): the trainer ranks come first in the trainer+fleet world,
then each member shard's ranks at its offset (:func:`megafleet.planner.rank_offsets`); the trainer
reads ``status.membership`` to learn the world size before it opens its rendezvous store. A failed
attempt stops every other member at once and is retried with the live shards, up to
``refit.max_attempts``; a Refit through a session has exactly one (a trainer's broadcast cannot be
replayed), and its failure breaks the session.
"""

from __future__ import annotations

import dataclasses
import logging

import pydantic

from megafleet import conditions, planner
from megafleet.fleet_state import pods
from megafleet.refits import context, fleet_lock, refit_status, session_end, session_status, session_view
from megafleet_protocol import agent_api, ports

log = logging.getLogger(__name__)


async def start(ctx: context.RefitContext) -> None:
    """Start an attempt on every shard whose agents answer: publish its membership (the fleet's lock
    and the Refit's status), then tell each pod's agent to receive."""
    reachable = await _reachable(ctx)
    if not reachable:
        await ctx.write({"phase": "Pending", "message": "no live shard to refit yet"})
        return
    layout = ctx.fleet.layout
    shard_size = layout.pods_per_shard * layout.ranks_per_pod
    rendezvous = ctx.spec.source.rendezvous
    trainer = rendezvous.trainer_world_size if rendezvous else 1
    membership = planner.rank_offsets(trainer, sorted(reachable), shard_size)
    published = refit_status.membership(membership)
    await fleet_lock.take(ctx, published)
    attempt = int(ctx.status.get("attempts", 0)) + 1
    await ctx.write(
        {
            "phase": "Running",
            "membership": published,
            "attempts": attempt,
            "startTime": conditions.now(),
            "message": f"attempt {attempt}: {len(reachable)} shards receive version {ctx.spec.version}",
        }
    )
    refused = await _tell(ctx, reachable, membership, attempt)
    if refused:  # a member that never started would leave the others waiting for it until their deadline
        ctx.body = {**ctx.body, "status": {**ctx.status, "attempts": attempt}}
        await fail(ctx, sorted(reachable), refused[0])


async def _reachable(ctx: context.RefitContext) -> dict[int, list[pods.Pod]]:
    """The running shards whose every agent answers and whose engine has not failed."""
    reachable = {}
    for shard, members in sorted(ctx.pods.items()):
        states = await ctx.agents.states([pod.ip for pod in members], ctx.token)
        if all(state.error is None and state.state != "failed" for state in states):
            reachable[shard] = members
    return reachable


async def _tell(
    ctx: context.RefitContext, reachable: dict[int, list[pods.Pod]], membership: planner.Membership, attempt: int
) -> list[str]:
    """Tell every pod of the member shards to receive; the refusals, each naming its pod."""
    refused: list[str] = []
    for shard, members in sorted(reachable.items()):
        for pod in members:
            # The shard's offset: each rank adds its own rank in the shard (MEGAFLEET_RANK).
            try:
                body = _request(ctx, membership, membership.offsets[shard], attempt)
            except pydantic.ValidationError as invalid:  # e.g. attempt 2 past port 65535: the agent would refuse it
                refused.append(f"{pod.name} refused: {invalid.errors()[0]['msg']}")
                continue
            error = await ctx.agents.refit_start(pod.ip, ctx.token, body)
            if error is not None:
                refused.append(f"{pod.name} refused: {error}")
    return refused


def _request(
    ctx: context.RefitContext, membership: planner.Membership, rank_offset: int, attempt: int
) -> agent_api.RefitRequest:
    spec, fleet = ctx.spec, ctx.fleet
    version, timeout, kv_cache_mode = spec.version, fleet.spec.refit.timeout_seconds, fleet.spec.engine.kv_cache_mode
    if spec.source.checkpoint is not None:
        return agent_api.CheckpointRefitRequest(
            version=version, timeout_seconds=timeout, kv_cache_mode=kv_cache_mode, path=spec.source.checkpoint.path
        )
    rendezvous = spec.source.rendezvous
    assert rendezvous is not None  # the model validator guarantees exactly one source
    return agent_api.PrepareRequest(
        version=version,
        timeout_seconds=timeout,
        kv_cache_mode=kv_cache_mode,
        transport=fleet.spec.refit.transport,
        bucket_size_mib=fleet.spec.refit.bucket_size_mi_b,
        rendezvous=agent_api.RendezvousBody(
            address=rendezvous.address,
            port=ports.attempt_port(rendezvous.port, attempt),  # where the trainer opens this attempt's store
            world_size=membership.world_size,
            rank_offset=rank_offset,
            trainer_world_size=membership.trainer_world_size,
        ),
    )


@dataclasses.dataclass
class _Progress:
    """What the members' agents report of the running attempt."""

    reports: list[agent_api.RefitStatusResponse] = dataclasses.field(default_factory=list)
    serving: list[int] = dataclasses.field(default_factory=list)
    """Member shards whose every agent reports it ready at the new version."""
    failure: str | None = None


async def collect(ctx: context.RefitContext) -> None:
    """Ask every member pod how the attempt goes: a member gone or failed fails the attempt; once
    every one succeeded the Refit finishes, the fleet moving to its version."""
    members = [entry["shard"] for entry in (ctx.status.get("membership") or {}).get("rankOffsets", [])]
    progress = await _progress(ctx, members)
    if progress is None:
        return  # not started on every member yet
    if progress.failure is not None:
        await fail(ctx, members, progress.failure)
        return
    if not all(report.phase == "succeeded" for report in progress.reports):
        return
    outcome = refit_status.succeeded(ctx.spec, members, progress.reports, progress.serving)
    await fleet_lock.finish(ctx.api, ctx.body, ctx.fleet_body, outcome)
    await _record_session_version(ctx)


async def _progress(ctx: context.RefitContext, members: list[int]) -> _Progress | None:
    """The members' reports, up to the first failure; None while one has not started the attempt."""
    found = _Progress()
    for shard in members:
        if shard not in ctx.pods:
            found.failure = f"shard {shard} left the fleet during the refit"
            return found
        for pod in ctx.pods[shard]:
            report = await ctx.agents.refit_status(pod.ip, ctx.token)
            if report is None:
                found.failure = f"the agent of {pod.name} is gone"
                return found
            if report.version != ctx.spec.version:
                return None  # not started there yet
            if report.phase == "failed":
                found.failure = f"{pod.name}: {report.error}"
                return found
            found.reports.append(report)
        shard_reports = found.reports[-len(ctx.pods[shard]) :]
        if all(report.state == "ready" and report.weight_version == ctx.spec.version for report in shard_reports):
            found.serving.append(shard)
    return found


async def fail(ctx: context.RefitContext, members: list[int], failure: str) -> None:
    """Stop every other member at once (not at its deadline), then retry or give up."""
    for shard in members:
        for pod in ctx.pods.get(shard, []):
            await ctx.agents.refit_abort(pod.ip, ctx.token, f"another member failed: {failure}")
    attempts = int(ctx.status.get("attempts", 1))
    if attempts >= ctx.max_attempts:
        await fleet_lock.finish(
            ctx.api, ctx.body, ctx.fleet_body, refit_status.failed(f"attempt {attempts} failed: {failure}")
        )
        await _break_session(ctx, failure)
        return
    log.warning(
        "refit %s/%s attempt %d failed (%s); retrying with the live shards", ctx.namespace, ctx.name, attempts, failure
    )
    await ctx.write({"phase": "Pending", "message": f"attempt {attempts} failed: {failure}"})


async def _record_session_version(ctx: context.RefitContext) -> None:
    """After a Refit through a session succeeded: the session's ``status.lastVersion``."""
    if ctx.spec.source.session is None:
        return
    session = await session_view.load(ctx.api, ctx.namespace, ctx.spec.source.session.name)
    if session is not None:
        version = ctx.spec.version
        await session_view.write(ctx.api, session, {"lastVersion": version, "message": f"version {version} received"})


async def _break_session(ctx: context.RefitContext, failure: str) -> None:
    """A failed Refit through a session breaks it: the trainer may have sent part of the version,
    its stream is out of step with the fleet's (the members leave, the hold goes)."""
    if ctx.spec.source.session is None:
        return
    session = await session_view.load(ctx.api, ctx.namespace, ctx.spec.source.session.name)
    if session is None or session.phase in session_status.ENDED:
        return
    message = f"Refit {ctx.name} (version {ctx.spec.version}) failed: {failure}"
    reason = session_status.REFIT_FAILED
    await session_end.end(ctx.api, ctx.agents, session, phase="Broken", reason=reason, message=message)
