"""Members of NeMo's wire must have received the same bytes (:func:`megafleet.refits.agreement.agreement`):
the first bucket whose digests differ names the member in the minority, or says there is no majority;
members that reported no digests are not compared."""

from __future__ import annotations

import pytest

from helpers.refit_reports import nemo_member
from megafleet.refits import agreement, member_reports


def digests(*per_member: list[str]) -> list[member_reports.MemberReport]:
    return [nemo_member(shard, found) for shard, found in enumerate(per_member)]


A, B, C = "a1a1", "b2b2", "c3c3"


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        pytest.param(digests([A, B], [A, B], [A, B]), None, id="all-agree"),
        pytest.param(digests([A, B]), None, id="one-member-nothing-to-compare"),
        pytest.param(digests([A, B], [], [A, B]), None, id="a-member-without-digests-is-not-compared"),
        pytest.param(
            digests([A, B], [A, C], [A, B]),
            (
                1,
                "f-s1-p0",
                1,
                "shard 1, pod f-s1-p0: bucket 1's digest c3c3 differs from the 2 of 3 members that agree on b2b2",
            ),
            id="minority-named",
        ),
        pytest.param(
            digests([A, B], [A, B], [A]),
            (
                2,
                "f-s2-p0",
                1,
                "shard 2, pod f-s2-p0: bucket 1's digest (none) differs from the 2 of 3 members that agree on b2b2",
            ),
            id="a-missing-bucket-disagrees",
        ),
        pytest.param(
            digests([A, B], [C, B]),
            (
                1,
                "f-s1-p0",
                0,
                "bucket 0: no digest is held by a majority of the 2 members (2 different ones; "
                "shard 1, pod f-s1-p0 has c3c3, another a1a1)",
            ),
            id="no-majority",
        ),
    ],
)
def test_members_digests_must_agree_bucket_by_bucket(
    reports: list[member_reports.MemberReport], expected: tuple[int, str, int, str] | None
) -> None:
    found = agreement.agreement(reports)
    assert (None if found is None else (found.shard, found.pod, found.bucket, found.message)) == expected


def test_a_disagreement_is_recorded_as_an_agreement_mismatch() -> None:
    found = agreement.agreement(digests([A, B, C], [A, C, C], [A, B, C]))
    assert found is not None
    verification = found.verification("checksum")
    assert verification.model_dump(mode="json", by_alias=True, exclude_none=True) == {
        "integrity": "checksum",
        "method": "agreement",
        "buckets": 3,
        "mismatch": {"shard": 1, "pod": "f-s1-p0", "bucket": 1, "firstTensor": ""},
    }
