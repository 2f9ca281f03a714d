"""An attempt's reports as the agent's refit status carries them (:mod:`megafleet_protocol.agent_api`).

Called by the agent's refit routes (:mod:`megafleet_engine.agent_server`) when they answer with an
attempt's status: each function turns one report of the attempt's record
(:mod:`~megafleet_engine.refit_attempts.phases`) into its wire model; durations go from seconds to
milliseconds. Pure; imports no torch.
"""

from __future__ import annotations

from megafleet_engine.refit_attempts import phases
from megafleet_protocol import agent_api
from megafleet_protocol.refit import verification as verification_module

__all__ = ["commit", "in_flight", "pause", "staging", "verification"]


def verification(outcome: verification_module.Verification | None) -> agent_api.VerificationReport | None:
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


def in_flight(report: phases.InFlight | None) -> agent_api.InFlightReport | None:
    if report is None:
        return None
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


def staging(report: phases.Staging | None) -> agent_api.StagingReport | None:
    if report is None:
        return None
    return agent_api.StagingReport(
        requested=report.requested, effective=report.effective, reason=report.reason, bytes=report.bytes
    )


def pause(report: phases.Pause | None) -> agent_api.PauseReport | None:
    if report is None:
        return None
    return agent_api.PauseReport(
        stall_milliseconds=report.stall_seconds * 1000,
        gate_closed_milliseconds=report.gate_closed_seconds * 1000,
        switch_milliseconds=report.switch_seconds * 1000,
        recompute_milliseconds=report.recompute_seconds * 1000,
    )


def commit(report: phases.Commit | None) -> agent_api.CommitReport | None:
    if report is None:
        return None
    return agent_api.CommitReport(
        requested=report.requested,
        effective=report.effective,
        reason=report.reason,
        committed=report.committed,
        expired=report.expired,
    )
