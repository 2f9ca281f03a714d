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
replayed), and its failure breaks the session. Under a two-phase commit (:mod:`.commit`) a failure
before the commit fails the attempt with nothing switched; a member that fails *after* it (the
operator's ``status.commit.decidedTime`` is on record, or the member reports the trainer's commit) is
fenced instead: its shard goes Stale and the Refit succeeds with the condition Degraded.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

import pydantic

from megafleet import conditions, planner
from megafleet.api import v1alpha1
from megafleet.fleet_state import pods
from megafleet.objects import Object
from megafleet.refits import (
    agreement,
    commit,
    context,
    fleet_lock,
    member_reports,
    modes,
    refit_status,
    session_end,
    session_status,
    session_view,
)
from megafleet_protocol import agent_api, ports

log = logging.getLogger(__name__)


async def start(ctx: context.RefitContext) -> None:
    """Start an attempt on every shard whose agents answer: resolve its modes against what their
    engines can do (:func:`.modes.resolve`), publish its membership (the fleet's lock and the Refit's
    status, with the modes), then tell each pod's agent to receive."""
    reachable = await _reachable(ctx)
    if not reachable:
        await ctx.write({"phase": "Pending", "message": "no live shard to refit yet"})
        return
    chosen = modes.resolve(ctx.fleet.spec, ctx.spec, ctx.capabilities)
    if await staging_unavailable(ctx, chosen):
        return
    layout = ctx.fleet.layout
    shard_size = layout.pods_per_shard * layout.ranks_per_pod
    rendezvous = ctx.spec.source.rendezvous
    trainer = rendezvous.trainer_world_size if rendezvous else 1
    membership = planner.rank_offsets(trainer, sorted(reachable), shard_size)
    published = refit_status.membership(membership)
    await fleet_lock.take(ctx, published)
    attempt = int(ctx.status.get("attempts", 0)) + 1
    running = {
        "phase": "Running",
        "membership": published,
        "attempts": attempt,
        "startTime": conditions.now(),
        "message": f"attempt {attempt}: {len(reachable)} shards receive version {ctx.spec.version}",
        **started(ctx, chosen),
    }
    await ctx.write(running)
    refused = await _tell(ctx, reachable, membership, attempt, chosen)
    if refused:  # a member that never started would leave the others waiting for it until their deadline
        ctx.body = {**ctx.body, "status": {**ctx.status, **running}}
        await fail(ctx, sorted(reachable), refused[0])


async def _reachable(ctx: context.RefitContext) -> dict[int, list[pods.Pod]]:
    """The running shards whose every agent answers and whose engine has not failed; their pods'
    capabilities go to ``ctx.capabilities``."""
    reachable = {}
    for shard, members in sorted(ctx.pods.items()):
        states = await ctx.agents.states([pod.ip for pod in members], ctx.token)
        if all(state.error is None and state.state != "failed" for state in states):
            reachable[shard] = members
            ctx.capabilities += [
                modes.MemberCapabilities(shard, pod.name, state.capabilities)
                for pod, state in zip(members, states, strict=True)
            ]
    return reachable


async def staging_unavailable(ctx: context.RefitContext, chosen: modes.Modes) -> bool:
    """``staging: required`` that a member cannot honour ends the Refit before any member is told to
    receive (Failed, ``StagingUnavailable``); the fleet is released if an earlier attempt held it."""
    if chosen.staging_unavailable is None:
        return False
    record = v1alpha1.StagingStatus(requested="required", effective="inPlace", reason=chosen.staging_unavailable)
    outcome = refit_status.failed(
        f"staging required, but {chosen.staging_unavailable}",
        refit_status.STAGING_UNAVAILABLE,
        report={"staging": record.model_dump(mode="json", by_alias=True, exclude_none=True)},
    )
    holding = ctx.fleet_body if ctx.fleet_refit.get("active") == ctx.name else None
    await fleet_lock.finish(ctx.api, ctx.body, holding, outcome)
    return True


def started(ctx: context.RefitContext, chosen: modes.Modes) -> Object:
    """What an attempt's start writes of its modes: :func:`.modes.started_status`, and the condition
    KeepUnavailable when the members were told to drain (False again when a retry keeps)."""
    status = modes.started_status(chosen)
    found = list(ctx.status.get("conditions") or [])
    verdict = chosen.keep_unavailable
    if verdict is None and conditions.find(found, refit_status.KEEP_UNAVAILABLE) is not None:
        verdict = conditions.Verdict(False, "Kept", "the members were told to keep")
    if verdict is not None:
        generation = int(ctx.body["metadata"].get("generation", 1))
        now = conditions.now()
        status["conditions"] = conditions.set_condition(
            found, refit_status.KEEP_UNAVAILABLE, verdict, generation=generation, now=now
        )
    return status


async def _tell(
    ctx: context.RefitContext,
    reachable: dict[int, list[pods.Pod]],
    membership: planner.Membership,
    attempt: int,
    chosen: modes.Modes,
) -> list[str]:
    """Tell every pod of the member shards to receive; the refusals, each naming its pod."""
    refused: list[str] = []
    for shard, members in sorted(reachable.items()):
        for pod in members:
            # The shard's offset: each rank adds its own rank in the shard (MEGAFLEET_RANK).
            try:
                body = _request(ctx, membership, membership.offsets[shard], attempt, chosen)
            except pydantic.ValidationError as invalid:  # e.g. attempt 2 past port 65535: the agent would refuse it
                refused.append(f"{pod.name} refused: {invalid.errors()[0]['msg']}")
                continue
            error = await ctx.agents.refit_start(pod.ip, ctx.token, body)
            if error is not None:
                refused.append(f"{pod.name} refused: {error}")
    return refused


def _request(
    ctx: context.RefitContext, membership: planner.Membership, rank_offset: int, attempt: int, chosen: modes.Modes
) -> agent_api.RefitRequest:
    spec, fleet = ctx.spec, ctx.fleet
    version, timeout, fields = spec.version, fleet.spec.refit.timeout_seconds, modes.request_fields(chosen)
    if spec.source.checkpoint is not None:
        return agent_api.CheckpointRefitRequest(
            version=version, timeout_seconds=timeout, path=spec.source.checkpoint.path, **fields
        )
    rendezvous = spec.source.rendezvous
    assert rendezvous is not None  # the model validator guarantees exactly one source
    return agent_api.PrepareRequest(
        version=version,
        timeout_seconds=timeout,
        **fields,
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

    reports: list[member_reports.MemberReport] = dataclasses.field(default_factory=list)
    serving: list[int] = dataclasses.field(default_factory=list)
    """Member shards whose every agent reports it ready at the new version."""
    failure: member_reports.Failure | None = None
    unstarted: dict[int, list[pods.Pod]] = dataclasses.field(default_factory=dict)
    """Member shards an agent of which does not show this attempt (never told, or not yet)."""
    fenced: dict[int, str] = dataclasses.field(default_factory=dict)
    """Member shards that failed after the commit, and why: they go Stale, the Refit is Degraded."""
    pods: int = 0
    """Member pods asked (those of the fenced shards excluded)."""


async def collect(ctx: context.RefitContext) -> None:
    """Ask every member pod how the attempt goes: a member gone or failed fails the attempt (a bucket
    that did not verify: ``BucketMismatch``), and so do members of NeMo's wire whose bucket digests
    disagree (``DigestDisagreement``); once every one succeeded the Refit finishes with their reports
    summed (:func:`.member_reports.summary`), the fleet moving to its version."""
    members = [entry["shard"] for entry in (ctx.status.get("membership") or {}).get("rankOffsets", [])]
    progress = await _progress(ctx, members, decided=commit.decided_time(ctx.status) is not None)
    if progress.failure is not None:
        failure = progress.failure
        await fail(ctx, members, failure.message, reason=failure.reason, report=failure.status)
        return
    if progress.unstarted:  # an operator may have died before telling them
        await _retell(ctx, members, progress.unstarted)
        return
    if commit.operator_commits(ctx.status) and not await _operator_commit(ctx, members, progress):
        return
    if not all(member.report.phase == "succeeded" for member in progress.reports):
        return
    if await _disagree(ctx, members, progress):
        return
    if progress.fenced and not progress.serving:
        message = "every member failed to switch after the commit: " + "; ".join(progress.fenced.values())
        await fleet_lock.finish(ctx.api, ctx.body, ctx.fleet_body, refit_status.failed(message))
        return
    summed = member_reports.summary(
        progress.reports,
        ctx.status,
        staging_requested=ctx.spec.staging or ctx.fleet.spec.refit.staging,
        integrity=ctx.fleet.spec.refit.integrity,
    )
    outcome = refit_status.succeeded(
        ctx.spec,
        members,
        [member.report for member in progress.reports],
        progress.serving,
        report=summed.status,
        keep_unavailable=summed.keep_unavailable,
    )
    if progress.fenced:
        outcome = refit_status.fenced(outcome, progress.fenced)
    await fleet_lock.finish(ctx.api, ctx.body, ctx.fleet_body, outcome)
    await _record_session_version(ctx)


async def _operator_commit(ctx: context.RefitContext, members: list[int], progress: _Progress) -> bool:
    """Under ``commit: operator``: decide (:func:`.commit.commit_decision`), record the decision and
    tell the members still staged; an attempt whose members cannot all stage in time fails
    (``CommitExpired``, nothing switched), and so does one whose members' digests disagree. Returns
    whether the decision is on record (the members switch)."""
    refit = ctx.fleet.spec.refit
    decision = commit.commit_decision(
        ctx.status,
        progress.reports,
        datetime.datetime.now(datetime.UTC),
        pods=progress.pods,
        wait_seconds=refit.timeout_seconds + refit.commit_grace_seconds,
    )
    if isinstance(decision, commit.Abort):
        await fail(ctx, members, decision.message, reason=refit_status.COMMIT_EXPIRED)
        return False
    if isinstance(decision, commit.Wait):
        return False
    if not decision.decided:
        if await _disagree(ctx, members, progress):  # before anything switches
            return False
        await commit.decide_commit(ctx)
    await commit.push_commit(ctx, progress.reports)
    return True


async def _disagree(ctx: context.RefitContext, members: list[int], progress: _Progress) -> bool:
    """Members whose digests disagree fail the attempt (``DigestDisagreement``): NeMo's wire's bucket
    digests, or the parameter digests of a checkpoint load or megatron-core's swap."""
    disagreement = agreement.agreement(progress.reports)
    if disagreement is None:
        return False
    checked = disagreement.verification(ctx.fleet.spec.refit.integrity)
    report = {"verification": checked.model_dump(mode="json", by_alias=True, exclude_none=True)}
    await fail(ctx, members, disagreement.message, reason=refit_status.DIGEST_DISAGREEMENT, report=report)
    return True


async def _retell(ctx: context.RefitContext, members: list[int], waiting: dict[int, list[pods.Pod]]) -> None:
    """Tell the members whose agents do not show this attempt yet, again: the status says the attempt
    runs, but the operator that wrote it may have stopped before it told every agent (a start is
    idempotent on the agent: the same request is answered, not rerun). The membership is the one
    published (the same shards give the same offsets); a refusal waits for the next poll."""
    ctx.pods = {shard: ctx.pods[shard] for shard in members}
    await _reachable(ctx)  # the members' capabilities, for the modes
    chosen = modes.resolve(ctx.fleet.spec, ctx.spec, ctx.capabilities)
    layout = ctx.fleet.layout
    rendezvous = ctx.spec.source.rendezvous
    trainer = rendezvous.trainer_world_size if rendezvous else 1
    membership = planner.rank_offsets(trainer, sorted(members), layout.pods_per_shard * layout.ranks_per_pod)
    attempt = int(ctx.status.get("attempts", 1))
    log.info("Refit %s: shards %s never started attempt %d; telling them again", ctx.name, sorted(waiting), attempt)
    for refused in await _tell(ctx, waiting, membership, attempt, chosen):
        log.warning("Refit %s: %s (tried again at the next poll)", ctx.name, refused)


async def _progress(ctx: context.RefitContext, members: list[int], *, decided: bool = False) -> _Progress:
    """The members' reports, up to the first failure, and the members that have not started the
    attempt; once the commit was ``decided`` (or a member reports the trainer's commit), a member
    that failed or is gone is fenced instead of failing the attempt."""
    found = _Progress()
    for shard in members:
        if shard not in ctx.pods:
            gone = f"shard {shard} left the fleet during the refit"
            if decided:
                found.fenced[shard] = gone
                continue
            found.failure = member_reports.Failure(gone)
            return found
        for pod in ctx.pods[shard]:
            report = await ctx.agents.refit_status(pod.ip, ctx.token)
            if report is not None and report.version != ctx.spec.version:
                found.unstarted[shard] = ctx.pods[shard]
                break
            if report is None or report.phase == "failed":
                failure = _failure(
                    pod, None if report is None else member_reports.MemberReport(shard, pod.name, report)
                )
                if decided or (report is not None and report.commit is not None and report.commit.committed):
                    found.fenced[shard] = f"shard {shard}: {failure.message}"
                    break
                found.failure = failure
                return found
            found.reports.append(member_reports.MemberReport(shard, pod.name, report))
        if shard in found.unstarted or shard in found.fenced:
            found.reports = [member for member in found.reports if member.shard != shard]
            continue
        found.pods += len(ctx.pods[shard])
        shard_reports = [member.report for member in found.reports[-len(ctx.pods[shard]) :]]
        if all(report.state == "ready" and report.weight_version == ctx.spec.version for report in shard_reports):
            found.serving.append(shard)
    return found


def _failure(pod: pods.Pod, member: member_reports.MemberReport | None) -> member_reports.Failure:
    """Why a member pod failed the attempt: its report's failure, or its agent is gone (``None``)."""
    return (
        member_reports.failure(member)
        if member is not None
        else member_reports.Failure(f"the agent of {pod.name} is gone")
    )


async def fail(
    ctx: context.RefitContext,
    members: list[int],
    failure: str,
    *,
    reason: str | None = None,
    report: Object | None = None,
) -> None:
    """Stop every other member at once (not at its deadline), then retry or give up; a Refit that
    gives up ends Failed with ``reason`` (None: the generic one) and ``report``'s status fields."""
    for shard in members:
        for pod in ctx.pods.get(shard, []):
            await ctx.agents.refit_abort(pod.ip, ctx.token, f"another member failed: {failure}")
    attempts = int(ctx.status.get("attempts", 1))
    if attempts >= ctx.max_attempts:
        outcome = refit_status.failed(f"attempt {attempts} failed: {failure}", reason, report=report)
        await fleet_lock.finish(ctx.api, ctx.body, ctx.fleet_body, outcome)
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
