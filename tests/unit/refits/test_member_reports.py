"""The members' refit reports summed into a Refit's status (:mod:`megafleet.refits.member_reports`):
sequence counts summed over shards (one report per shard), pauses per shard with their median and
maximum, staging staged only when every member staged, the verification method all members share;
a failed member's report becomes the Refit's Failed reason and message."""

from __future__ import annotations

from typing import Any

import pytest

from helpers.refit_reports import member
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.refits import member_reports, modes, refit_status
from megafleet_protocol import agent_api


def kept(effective: str = "keep", reason: str | None = None, **counts: int) -> agent_api.InFlightReport:
    return agent_api.InFlightReport(
        requested="keep", effective=effective, kv_cache_mode="recompute", reason=reason, **counts
    )


def pause(stall: float, gate: float = 0.0, recompute: float = 0.0) -> agent_api.PauseReport:
    return agent_api.PauseReport(
        stall_milliseconds=stall, gate_closed_milliseconds=gate, recompute_milliseconds=recompute
    )


def staged(effective: str = "staged", nbytes: int = 0, reason: str | None = None) -> agent_api.StagingReport:
    return agent_api.StagingReport(requested="auto", effective=effective, bytes=nbytes, reason=reason)


ASKED = v1alpha1.InFlightStatus(requested="keep", effective="keep", kv_cache_mode="recompute")


def test_sequence_counts_are_summed_over_shards_from_one_report_each() -> None:
    reports = [
        member(0, 0, in_flight=kept(kept=3, recomputed_tokens=300)),
        member(0, 1, in_flight=kept(kept=3, recomputed_tokens=300)),  # the same sequences, on the shard's other pod
        member(1, 0, in_flight=kept(kept=5, recomputed_tokens=80)),
        member(2, 0),  # an engine that reports nothing of them
    ]

    found, verdict = member_reports.in_flight_summary(reports, ASKED)

    assert (found.kept, found.recomputed_tokens, found.drained, found.aborted) == (8, 380, 0, 0)
    assert (found.requested, found.effective, found.kv_cache_mode, found.reason, verdict) == (
        "keep",
        "keep",
        "recompute",
        None,
        None,
    )


def test_a_member_that_drained_on_its_own_says_so_and_keep_becomes_unavailable() -> None:
    reports = [
        member(0, in_flight=kept(kept=2)),
        member(1, in_flight=kept("drain", "recompute needs a rebuilt cache", drained=4)),
    ]

    found, verdict = member_reports.in_flight_summary(reports, ASKED)

    assert (found.effective, found.kept, found.drained) == ("drain", 2, 4)
    assert found.reason == "shard 1, pod f-s1-p0 ran drain: recompute needs a rebuilt cache"
    assert verdict is not None and (verdict.status, verdict.reason) == (True, modes.ENGINE_DRAINED)
    asked_drain = ASKED.model_copy(update={"requested": "drain", "effective": "drain"})
    same, none = member_reports.in_flight_summary([member(0, in_flight=kept("drain", drained=1))], asked_drain)
    assert (same.effective, same.reason, none) == ("drain", None, None)


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        pytest.param([member(0), member(1)], None, id="nobody-reported"),
        pytest.param(
            [member(0, pause=pause(11.4, 13.0)), member(1, pause=pause(9.6, 9.0)), member(2, pause=pause(40.0, 41.0))],
            v1alpha1.PauseStatus(
                stall_p50_milliseconds=11,
                stall_max_milliseconds=40,
                gate_closed_max_milliseconds=41,
                recompute_max_milliseconds=0,
                shards=[
                    v1alpha1.ShardPause(shard=0, stall_milliseconds=11),
                    v1alpha1.ShardPause(shard=1, stall_milliseconds=10),
                    v1alpha1.ShardPause(shard=2, stall_milliseconds=40),
                ],
            ),
            id="median-of-three",
        ),
        pytest.param(
            [
                member(0, 0, pause=pause(5.0)),
                member(0, 1, pause=pause(7.0, recompute=3.0)),  # a shard stalls as long as its slowest pod
                member(1, 0, pause=pause(20.0, recompute=12.0)),
            ],
            v1alpha1.PauseStatus(
                stall_p50_milliseconds=7,  # nearest rank: the lower of two
                stall_max_milliseconds=20,
                gate_closed_max_milliseconds=0,
                recompute_max_milliseconds=12,
                shards=[
                    v1alpha1.ShardPause(shard=0, stall_milliseconds=7),
                    v1alpha1.ShardPause(shard=1, stall_milliseconds=20),
                ],
            ),
            id="per-shard-longest-pod",
        ),
    ],
)
def test_the_pause_is_each_shards_longest_stall_with_median_and_maximum(
    reports: list[member_reports.MemberReport], expected: v1alpha1.PauseStatus | None
) -> None:
    assert member_reports.pause_summary(reports) == expected


@pytest.mark.parametrize(
    ("reports", "requested", "expected"),
    [
        pytest.param(
            [member(0)], "off", v1alpha1.StagingStatus(requested="off", effective="inPlace"), id="off-is-in-place"
        ),
        pytest.param(
            [member(0, staging=staged(nbytes=10)), member(1, staging=staged(nbytes=12))],
            "auto",
            v1alpha1.StagingStatus(requested="auto", effective="staged", bytes=12),
            id="every-member-staged",
        ),
        pytest.param(
            [member(0, staging=staged(nbytes=10)), member(1, staging=staged("inPlace", reason="free 9.8 GiB"))],
            "auto",
            v1alpha1.StagingStatus(
                requested="auto",
                effective="inPlace",
                bytes=10,
                reason="shard 1, pod f-s1-p0 received in place: free 9.8 GiB",
            ),
            id="one-in-place",
        ),
        pytest.param(
            [member(0)],
            "auto",
            v1alpha1.StagingStatus(
                requested="auto", effective="inPlace", reason="shard 0, pod f-s0-p0 received in place"
            ),
            id="an-engine-that-does-not-say",
        ),
    ],
)
def test_staging_is_staged_only_when_every_member_staged(
    reports: list[member_reports.MemberReport], requested: Any, expected: v1alpha1.StagingStatus
) -> None:
    assert member_reports.staging_summary(reports, requested) == expected


def verified(method: str, buckets: int = 4) -> agent_api.VerificationReport:
    return agent_api.VerificationReport(integrity="checksum", method=method, buckets=buckets)


@pytest.mark.parametrize(
    ("reports", "integrity", "expected"),
    [
        pytest.param([member(0), member(1)], "none", None, id="nothing-asked-nothing-reported"),
        pytest.param(
            [
                member(0, verification=verified("trainerDigest", 4)),
                member(1, verification=verified("trainerDigest", 6)),
            ],
            "checksum",
            v1alpha1.VerificationStatus(integrity="checksum", method="trainerDigest", buckets=6),
            id="all-verified",
        ),
        pytest.param(
            [member(0, verification=verified("trainerDigest")), member(1)],
            "checksum",
            v1alpha1.VerificationStatus(integrity="checksum", method="none", buckets=4),
            id="one-unverified-member-leaves-it-unverified",
        ),
    ],
)
def test_the_verification_method_is_the_one_every_member_shares(
    reports: list[member_reports.MemberReport], integrity: Any, expected: v1alpha1.VerificationStatus | None
) -> None:
    assert member_reports.verification_summary(reports, integrity) == expected


def test_a_bucket_mismatch_fails_the_refit_naming_shard_pod_bucket_and_first_tensor() -> None:
    mismatch = agent_api.BucketMismatch(bucket=3, first_tensor="model.layers.7.mlp.down_proj.weight")
    failed = member(
        1,
        phase="failed",
        error="refit to v2 failed before the switch",
        verification=agent_api.VerificationReport(
            integrity="checksum", method="trainerDigest", buckets=3, mismatch=mismatch
        ),
    )

    found = member_reports.failure(failed)

    assert found.reason == refit_status.BUCKET_MISMATCH
    assert found.message == (
        "shard 1, pod f-s1-p0: bucket 3 (first tensor model.layers.7.mlp.down_proj.weight) did not match its "
        "digest (refit to v2 failed before the switch)"
    )
    assert found.status == {
        "verification": {
            "integrity": "checksum",
            "method": "trainerDigest",
            "buckets": 3,
            "mismatch": {
                "shard": 1,
                "pod": "f-s1-p0",
                "bucket": 3,
                "firstTensor": "model.layers.7.mlp.down_proj.weight",
            },
        }
    }


@pytest.mark.parametrize(
    ("failed", "reason", "message"),
    [
        pytest.param(
            member(0, phase="failed", error="bucket 2 of 3 not received"),
            None,
            "f-s0-p0: bucket 2 of 3 not received",
            id="any-other-error-as-before",
        ),
        pytest.param(
            member(
                0,
                phase="failed",
                error="no staging copy",
                staging=agent_api.StagingReport(requested="required", effective="inPlace", reason="free 9.8 GiB"),
            ),
            refit_status.STAGING_UNAVAILABLE,
            "shard 0, pod f-s0-p0: staging required, but free 9.8 GiB",
            id="staging-required",
        ),
        pytest.param(
            member(
                1,
                phase="failed",
                error="refit to v2 failed",
                verification=agent_api.VerificationReport(
                    integrity="checksum", method="agreement", buckets=2, non_finite="lm_head.weight"
                ),
            ),
            refit_status.NON_FINITE_WEIGHTS,
            "shard 1, pod f-s1-p0: tensor lm_head.weight arrived holding NaN or Inf (refit to v2 failed)",
            id="non-finite-weights",
        ),
    ],
)
def test_a_failed_member_gives_the_refits_reason(
    failed: member_reports.MemberReport, reason: str | None, message: str
) -> None:
    found = member_reports.failure(failed)
    assert (found.reason, found.message) == (reason, message)


def test_a_success_summary_holds_every_field_the_members_reported() -> None:
    started: Object = {"inFlight": ASKED.model_dump(mode="json", by_alias=True, exclude_none=True), "staging": None}
    reports = [
        member(0, in_flight=kept(kept=2), pause=pause(12.0), staging=staged(nbytes=8)),
        member(1, in_flight=kept(kept=1), pause=pause(14.0), staging=staged(nbytes=8)),
    ]

    found = member_reports.summary(reports, started, staging_requested="auto", integrity="none")

    assert found.keep_unavailable is None
    assert found.status["inFlight"]["kept"] == 3
    assert found.status["staging"] == {"requested": "auto", "effective": "staged", "bytes": 8}
    assert found.status["pause"]["stallMaxMilliseconds"] == 14
    assert "verification" not in found.status
    in_place: Object = {**started, "staging": {"requested": "auto", "effective": "inPlace", "reason": "x", "bytes": 0}}
    kept_record = member_reports.summary(reports, in_place, staging_requested="auto", integrity="none").status
    assert kept_record["staging"] == in_place["staging"], "what the start decided stays"
