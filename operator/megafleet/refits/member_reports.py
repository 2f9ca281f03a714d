"""The member pods' refit reports summed into a Refit's status: pure functions under table tests.

Called by :func:`.attempts.collect` with every member pod's ``GET /v1/refit/status`` answer, each
tagged with its shard and pod (:class:`MemberReport`):

* a member that failed: :func:`failure`, the Refit's Failed reason and message (``BucketMismatch``
  naming shard, pod, bucket and first tensor; ``NonFiniteWeights`` naming the tensor;
  ``StagingUnavailable``; else the member's error);
* every member succeeded: :func:`summary`, the status fields ``inFlight`` (:func:`in_flight_summary`,
  counts summed over the shards), ``staging`` (:func:`staging_summary`), ``pause``
  (:func:`pause_summary`) and ``verification`` (:func:`verification_summary`).

A shard's ranks hold the same sequences (they step in lockstep), so sequence counts come from one
report per shard, its first pod's; durations take the longest of a shard's pods.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from megafleet import conditions
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.refits import modes, refit_status
from megafleet_protocol import agent_api, vocabulary


@dataclasses.dataclass(frozen=True)
class MemberReport:
    """One member pod's answer to ``GET /v1/refit/status``."""

    shard: int
    pod: str
    report: agent_api.RefitStatusResponse

    @property
    def where(self) -> str:
        return f"shard {self.shard}, pod {self.pod}"


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why an attempt failed, as its Refit reports it if the attempt is the last."""

    message: str
    reason: str | None = None
    """The Failed condition's reason (None: the generic ``Failed``)."""
    status: Object = dataclasses.field(default_factory=dict)
    """Status fields that locate the failure (``verification.mismatch``, ``staging``)."""


@dataclasses.dataclass(frozen=True)
class Summary:
    """What the members' reports add to a successful Refit's status."""

    status: Object
    """``inFlight``, ``staging``, ``pause`` and ``verification``, each when known."""
    keep_unavailable: conditions.Verdict | None = None
    """A member asked to keep drained on its own (the condition KeepUnavailable), or None."""


def failure(member: MemberReport) -> Failure:
    """The failure of a member whose attempt failed: a bucket that did not verify
    (``BucketMismatch``), a tensor holding NaN or Inf (``NonFiniteWeights``), staging required and not
    possible (``StagingUnavailable``), or its error."""
    report = member.report
    verification, staging = report.verification, report.staging
    if verification is not None and verification.mismatch is not None:
        found = verification.mismatch
        message = (
            f"{member.where}: bucket {found.bucket} (first tensor {found.first_tensor}) did not match "
            f"its digest" + (f" ({report.error})" if report.error else "")
        )
        mismatch = v1alpha1.MismatchStatus(
            shard=member.shard, pod=member.pod, bucket=found.bucket, first_tensor=found.first_tensor
        )
        checked = v1alpha1.VerificationStatus(
            integrity=verification.integrity,
            method=verification.method,
            buckets=verification.buckets,
            mismatch=mismatch,
        )
        return Failure(message, refit_status.BUCKET_MISMATCH, {"verification": _dump(checked)})
    if verification is not None and verification.non_finite is not None:
        message = f"{member.where}: tensor {verification.non_finite} arrived holding NaN or Inf" + (
            f" ({report.error})" if report.error else ""
        )
        return Failure(message, refit_status.NON_FINITE_WEIGHTS)
    if staging is not None and staging.requested == "required" and staging.effective != "staged":
        why = staging.reason or report.error or "no room for the staging copy"
        record = v1alpha1.StagingStatus(requested="required", effective=staging.effective, reason=why)
        return Failure(
            f"{member.where}: staging required, but {why}", refit_status.STAGING_UNAVAILABLE, {"staging": _dump(record)}
        )
    return Failure(f"{member.pod}: {report.error}")


def summary(
    reports: Sequence[MemberReport],
    started: Object,
    *,
    staging_requested: vocabulary.StagingMode,
    integrity: vocabulary.Integrity,
) -> Summary:
    """The status fields of a refit every member reported succeeded. ``started`` is the Refit's
    status as its attempt started (:func:`.modes.started_status`: ``inFlight``, maybe ``staging``)."""
    status: Object = {}
    keep_unavailable = None
    if "inFlight" in started:
        asked = v1alpha1.InFlightStatus.model_validate(started["inFlight"])
        in_flight, keep_unavailable = in_flight_summary(reports, asked)
        status["inFlight"] = _dump(in_flight)
    if started.get("staging") is not None:
        status["staging"] = started["staging"]
    else:
        status["staging"] = _dump(staging_summary(reports, staging_requested))
    pause = pause_summary(reports)
    if pause is not None:
        status["pause"] = _dump(pause)
    verification = verification_summary(reports, integrity)
    if verification is not None:
        status["verification"] = _dump(verification)
    return Summary(status, keep_unavailable)


def in_flight_summary(
    reports: Sequence[MemberReport], asked: v1alpha1.InFlightStatus
) -> tuple[v1alpha1.InFlightStatus, conditions.Verdict | None]:
    """``asked`` (what the members were told) with the sequence counts summed over the shards, and
    the first member whose engine ran another mode than it was told (its effective mode and reason);
    with the KeepUnavailable verdict when that member was told to keep."""
    counted = [member.report.in_flight for member in _first_per_shard(reports) if member.report.in_flight]
    totals = {
        "kept": sum(found.kept for found in counted),
        "drained": sum(found.drained for found in counted),
        "aborted": sum(found.aborted for found in counted),
        "aborted_tokens": sum(found.aborted_tokens for found in counted),
        "recomputed_tokens": sum(found.recomputed_tokens for found in counted),
    }
    other = next(
        (m for m in reports if m.report.in_flight is not None and m.report.in_flight.effective != asked.effective),
        None,
    )
    if other is None or other.report.in_flight is None:
        return asked.model_copy(update=totals), None
    ran = other.report.in_flight
    reason = f"{other.where} ran {ran.effective}" + (f": {ran.reason}" if ran.reason else "")
    verdict = None
    if asked.effective == "keep":
        verdict = conditions.Verdict(True, modes.ENGINE_DRAINED, reason)
    return asked.model_copy(update={**totals, "effective": ran.effective, "reason": reason}), verdict


def staging_summary(reports: Sequence[MemberReport], requested: vocabulary.StagingMode) -> v1alpha1.StagingStatus:
    """Where the members received the weights: ``staged`` only if every member pod staged (else the
    first that did not says why); ``bytes`` the largest staging copy of any of them."""
    if requested == "off":
        return v1alpha1.StagingStatus(requested="off", effective="inPlace")
    largest = max((m.report.staging.bytes for m in reports if m.report.staging is not None), default=0)
    in_place = next((m for m in reports if m.report.staging is None or m.report.staging.effective != "staged"), None)
    if in_place is None:
        return v1alpha1.StagingStatus(requested=requested, effective="staged", bytes=largest)
    why = in_place.report.staging.reason if in_place.report.staging is not None else None
    reason = f"{in_place.where} received in place" + (f": {why}" if why else "")
    return v1alpha1.StagingStatus(requested=requested, effective="inPlace", reason=reason, bytes=largest)


def pause_summary(reports: Sequence[MemberReport]) -> v1alpha1.PauseStatus | None:
    """How long the refit kept the member shards from generating, in whole milliseconds: each shard's
    stall (its longest pod's), their median (nearest rank) and longest, and the longest gate-closed
    and recompute times of any pod. None when no member reported its pause."""
    paused = [(member.shard, member.report.pause) for member in reports if member.report.pause is not None]
    if not paused:
        return None
    stalls: dict[int, float] = {}
    for shard, pause in paused:
        stalls[shard] = max(stalls.get(shard, 0.0), pause.stall_milliseconds)
    ordered = sorted(_milliseconds(stall) for stall in stalls.values())
    return v1alpha1.PauseStatus(
        stall_p50_milliseconds=ordered[math.ceil(len(ordered) / 2) - 1],
        stall_max_milliseconds=ordered[-1],
        gate_closed_max_milliseconds=max(_milliseconds(pause.gate_closed_milliseconds) for _, pause in paused),
        recompute_max_milliseconds=max(_milliseconds(pause.recompute_milliseconds) for _, pause in paused),
        shards=[
            v1alpha1.ShardPause(shard=shard, stall_milliseconds=_milliseconds(stall))
            for shard, stall in sorted(stalls.items())
        ],
    )


def verification_summary(
    reports: Sequence[MemberReport], integrity: vocabulary.Integrity
) -> v1alpha1.VerificationStatus | None:
    """What verified the bytes: the members' method when they all agree on one, else ``none`` (one
    member unverified leaves the refit unverified); None when integrity is none and no member
    reported a verification."""
    found = [member.report.verification for member in reports]
    if integrity == "none" and all(item is None for item in found):
        return None
    methods: set[vocabulary.VerificationMethod] = {item.method if item is not None else "none" for item in found}
    method = methods.pop() if len(methods) == 1 else "none"
    buckets = max((item.buckets for item in found if item is not None), default=0)
    return v1alpha1.VerificationStatus(integrity=integrity, method=method, buckets=buckets)


def _first_per_shard(reports: Sequence[MemberReport]) -> list[MemberReport]:
    """One report per shard: its first pod's (the reports come in pod order)."""
    seen: dict[int, MemberReport] = {}
    for member in reports:
        seen.setdefault(member.shard, member)
    return [seen[shard] for shard in sorted(seen)]


def _milliseconds(value: float) -> int:
    return max(0, round(value))


def _dump(model: v1alpha1.ApiModel) -> Object:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)
