"""The operator's half of the two-phase commit: decide that a staged Refit's version goes live, record
the decision before anyone acts on it, and tell the members.

Called by :func:`.attempts.collect` on every poll of a Running Refit whose members were told
``commit: operator`` (:mod:`.modes`): they receive into their staging copies while serving, report
``staged`` once verified, and wait for ``POST /v1/refit/commit`` until their deadline plus
``commitGraceSeconds``. Steps:

* :func:`commit_decision` (pure, table-tested): :class:`Commit` once every member pod staged (or
  already serves the version) or once the decision is on record, :class:`Abort` when the members'
  wait is about to run out (``CommitExpired``), else :class:`Wait`;
* :func:`decide_commit`: the write-ahead record, ``status.commit.decidedTime``, patched *before* any
  member is told; from then on the Refit succeeds whatever happens to a member (a member that fails to
  switch is fenced, :func:`.attempts.collect`), and an operator that restarts pushes the commit again;
* :func:`push_commit`: ``POST /v1/refit/commit`` to every member pod still ``staged`` (idempotent on
  the agent: a pod that already switched answers 200).

Under ``commit: trainer`` the trainer decides on its own wire and the operator only collects; under
``local`` there is nothing to decide.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Sequence

from megafleet import conditions
from megafleet.objects import Object
from megafleet.refits import context, member_reports

__all__ = ["COMMIT_MARGIN_SECONDS", "Abort", "Commit", "Wait", "commit_decision", "decide_commit", "push_commit"]

log = logging.getLogger(__name__)

COMMIT_MARGIN_SECONDS = 2.0
"""A decision this close to the members' commit deadline is not taken: they might give their staged
copies up before the commit reaches them; the Refit fails ``CommitExpired`` instead."""
SWITCHED = ("switching", "resuming", "succeeded")
"""Member phases past their commit (or that never waited for one)."""


@dataclasses.dataclass(frozen=True)
class Commit:
    """Every member still ``staged`` is told to switch; ``decided``: the decision is already on record."""

    decided: bool


@dataclasses.dataclass(frozen=True)
class Wait:
    """Not every member has staged yet."""

    why: str


@dataclasses.dataclass(frozen=True)
class Abort:
    """The members' wait for a commit runs out before every one staged: the attempt fails."""

    message: str


def decided_time(status: Object) -> str | None:
    """When the operator decided to commit the Refit's version (``status.commit.decidedTime``), or None."""
    found = (status.get("commit") or {}).get("decidedTime")
    return None if found is None else str(found)


def operator_commits(status: Object) -> bool:
    """Whether the members of the running attempt wait for the operator's commit."""
    return (status.get("commit") or {}).get("mode") == "operator"


def commit_decision(
    status: Object,
    reports: Sequence[member_reports.MemberReport],
    now: datetime.datetime,
    *,
    pods: int,
    wait_seconds: float,
) -> Commit | Wait | Abort:
    """What the operator does for a Running Refit under ``commit: operator`` whose members (``pods``
    member pods in all) report ``reports``, none failed, at ``now``: commit once the decision is on
    record or every member pod staged or switched; abort once ``now`` is within
    :data:`COMMIT_MARGIN_SECONDS` of ``status.startTime`` plus ``wait_seconds`` (the members'
    ``timeoutSeconds`` plus ``commitGraceSeconds``); else wait."""
    if decided_time(status) is not None:
        return Commit(decided=True)
    waiting = [member for member in reports if member.report.phase not in ("staged", *SWITCHED)]
    if len(reports) == pods and not waiting:
        return Commit(decided=False)
    started = status.get("startTime")
    if started is not None:
        at = datetime.datetime.fromisoformat(str(started).replace("Z", "+00:00"))
        left = at + datetime.timedelta(seconds=wait_seconds) - now
        if left.total_seconds() <= COMMIT_MARGIN_SECONDS:
            where = waiting[0].where if waiting else f"{pods - len(reports)} member pods"
            return Abort(
                f"CommitExpired: not every member staged within timeoutSeconds plus commitGraceSeconds "
                f"({wait_seconds:g} s; {where} had not): no shard switched"
            )
    if waiting:
        first = waiting[0]
        return Wait(f"{first.where} is {first.report.phase}")
    return Wait(f"{len(reports)} of {pods} member pods reported")


async def decide_commit(ctx: context.RefitContext) -> None:
    """Record the decision (``status.commit.decidedTime``) before any member is told to switch."""
    commit = {**(ctx.status.get("commit") or {}), "decidedTime": conditions.now()}
    message = f"commit decided: every member switches to version {ctx.spec.version}"
    update: Object = {"commit": commit, "message": message}
    await ctx.write(update)
    ctx.body = {**ctx.body, "status": {**ctx.status, **update}}
    log.info("Refit %s/%s: commit of version %d decided", ctx.namespace, ctx.name, ctx.spec.version)


async def push_commit(ctx: context.RefitContext, reports: Sequence[member_reports.MemberReport]) -> None:
    """Tell every member pod still ``staged`` to switch (a pod that switched meanwhile answers 200; one
    whose wait ran out answers 409 and shows failed at the next poll, where it is fenced)."""
    for member in reports:
        if member.report.phase != "staged":
            continue
        pod = next((pod for pod in ctx.pods.get(member.shard, []) if pod.name == member.pod), None)
        if pod is None:
            continue
        error = await ctx.agents.refit_commit(pod.ip, ctx.token, ctx.spec.version)
        if error is not None:
            log.warning("Refit %s: commit to %s: %s", ctx.name, member.where, error)
