"""The refit status's reports as the agent API's models: what verified the bytes, what happened to the
sequences in flight, the staging copy and the pause.

Called by :mod:`megafleet_engine.agent_server` when it answers ``GET /v1/refit/status`` (and every
refit call): each function turns one part of an attempt's
:class:`~megafleet_engine.refit_attempts.phases.Snapshot` into its
:mod:`megafleet_protocol.agent_api` model.
"""

from __future__ import annotations

from megafleet_engine.refit_attempts import phases
from megafleet_protocol import agent_api
from megafleet_protocol.refit import verification

__all__ = ["in_flight_report", "pause_report", "staging_report", "verification_model"]


def verification_model(outcome: verification.Verification | None) -> agent_api.VerificationReport | None:
    if outcome is None:
        return None
    mismatch = outcome.mismatch
    return agent_api.VerificationReport(
        integrity=outcome.integrity,
        method=outcome.method,
        buckets=outcome.buckets,
        mismatch=None
        if mismatch is None
        else agent_api.BucketMismatch(bucket=mismatch.bucket, first_tensor=mismatch.first_tensor),
        bucket_digests=list(outcome.bucket_digests),
        non_finite=outcome.non_finite,
    )


def in_flight_report(report: phases.InFlight) -> agent_api.InFlightReport:
    return agent_api.InFlightReport(
        requested=report.requested,
        effective=report.effective,
        kv_cache_mode=report.kv_cache_mode,
        reason=report.reason,
        kept=report.kept,
        drained=report.drained,
        aborted=report.aborted,
        aborted_tokens=report.aborted_tokens,
        recomputed_tokens=report.recomputed_tokens,
    )


def staging_report(report: phases.Staging) -> agent_api.StagingReport:
    return agent_api.StagingReport(
        requested=report.requested, effective=report.effective, reason=report.reason, bytes=report.bytes
    )


def pause_report(report: phases.Pause) -> agent_api.PauseReport:
    return agent_api.PauseReport(
        stall_milliseconds=report.stall_seconds * 1000,
        gate_closed_milliseconds=report.gate_closed_seconds * 1000,
        switch_milliseconds=report.switch_seconds * 1000,
        recompute_milliseconds=report.recompute_seconds * 1000,
    )
