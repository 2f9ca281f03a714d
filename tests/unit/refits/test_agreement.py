"""Members of NeMo's wire must have received the same bytes (:func:`megafleet.refits.agreement.agreement`):
the first bucket whose digests differ names the member in the minority, or says there is no majority;
members that reported no digests are not compared. Ranks that digested their own parameters (a
checkpoint load, megatron-core's swap) are compared with the pods at the same position of every shard."""

from __future__ import annotations

import pytest

from helpers.refit_reports import member, nemo_member
from megafleet.refits import agreement, member_reports
from megafleet_protocol import agent_api


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


def per_rank(shard: int, pod: int, found: list[str], **fields: object) -> member_reports.MemberReport:
    """A member pod whose ranks digested their own parameters (a checkpoint load, unless told)."""
    verification = agent_api.VerificationReport(
        integrity="checksum", method="agreement", buckets=len(found), bucket_digests=found
    )
    return member(shard, pod, verification=verification, **fields)


@pytest.mark.parametrize(
    "source", [{"source": "checkpoint"}, {"source": "nemo", "transport": "reshard"}], ids=["checkpoint", "megatron"]
)
def test_ranks_that_digested_their_own_parameters_are_compared_with_the_same_position_of_every_shard(
    source: dict[str, str],
) -> None:
    """Two pods per shard (PP across pods): the pods of one shard hold different parameters, the first
    pod of every shard the same ones, the second pod of every shard the same ones."""
    first, second = [A, B], [C, A]
    agree = [per_rank(shard, pod, found, **source) for shard in range(3) for pod, found in enumerate((first, second))]
    assert agreement.agreement(agree) is None, "pods of one shard differ, replicas agree"
    assert [[m.pod for m, _ in group] for group in agreement.replicas(agree)] == [
        ["f-s0-p0", "f-s1-p0", "f-s2-p0"],
        ["f-s0-p1", "f-s1-p1", "f-s2-p1"],
    ]
    off = list(agree)
    off[5] = per_rank(2, 1, [C, B], **source)
    found = agreement.agreement(off)
    assert found is not None
    assert (found.shard, found.pod, found.bucket) == (2, "f-s2-p1", 1)
    assert (
        found.message
        == "shard 2, pod f-s2-p1: bucket 1's digest b2b2 differs from the 2 of 3 members that agree on a1a1"
    )
    assert agreement.agreement([per_rank(0, 0, first, **source), per_rank(0, 1, second, **source)]) is None, (
        "one shard alone has nothing to be compared with"
    )


def test_nemos_broadcast_is_compared_across_every_pod() -> None:
    """Every rank of NeMo's wire receives the same bytes: the second pod of a shard is compared with the first."""
    reports = [nemo_member(0, [A, B]), member_reports.MemberReport(0, "f-s0-p1", nemo_member(0, [A, C]).report)]
    found = agreement.agreement(reports)
    assert found is not None and (found.pod, found.bucket) == ("f-s0-p1", 1)
