"""Whether the members of a Refit through NeMo's wire received the same bytes: a pure comparison of
their per-bucket digests, under table tests.

NeMo RL's collective carries no digest, but every inference rank receives the same broadcast bytes
(docs/refit-protocol.md, "NeMo RL's collective"), so each member pod reports the digest of every
bucket it received (``verification.bucketDigests``) and the members must agree. Called by
:func:`.attempts.collect` once every member of a Refit through a NeMo session reported succeeded: a
member in the minority fails the Refit ``DigestDisagreement`` naming it and the bucket; with no
majority the Refit fails too, naming the first member that differs from the most common digest.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from megafleet.api import v1alpha1
from megafleet.refits import member_reports
from megafleet_protocol import vocabulary

_MISSING = "(none)"
"""A bucket a member reported no digest for."""


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """The first bucket the members' digests disagree on, and the member named for it."""

    shard: int
    pod: str
    bucket: int
    message: str
    buckets: int = 0
    """The most buckets any member reported a digest for."""

    def verification(self, integrity: vocabulary.Integrity) -> v1alpha1.VerificationStatus:
        """The Refit's ``status.verification`` that records it."""
        mismatch = v1alpha1.MismatchStatus(shard=self.shard, pod=self.pod, bucket=self.bucket)
        return v1alpha1.VerificationStatus(
            integrity=integrity, method="agreement", buckets=self.buckets, mismatch=mismatch
        )


def agreement(reports: Sequence[member_reports.MemberReport]) -> Disagreement | None:
    """The first bucket (in transfer order) whose digest is not the same on every member that
    reported digests, or None when they all agree (or fewer than two reported any: nothing to
    compare). A member that reported fewer buckets than another disagrees on the missing ones."""
    digests = [
        (member, member.report.verification.bucket_digests)
        for member in reports
        if member.report.verification is not None and member.report.verification.bucket_digests
    ]
    if len(digests) < 2:
        return None
    buckets = max(len(found) for _, found in digests)
    for bucket in range(buckets):
        votes = [(member, found[bucket] if bucket < len(found) else _MISSING) for member, found in digests]
        counted = collections.Counter(digest for _, digest in votes)
        if len(counted) == 1:
            continue
        common, count = counted.most_common(1)[0]
        member, digest = next((member, digest) for member, digest in votes if digest != common)
        if count * 2 > len(votes) and common != _MISSING:
            message = (
                f"{member.where}: bucket {bucket}'s digest {digest} differs from the {count} of {len(votes)} "
                f"members that agree on {common}"
            )
        else:
            message = (
                f"bucket {bucket}: no digest is held by a majority of the {len(votes)} members "
                f"({len(counted)} different ones; {member.where} has {digest}, another {common})"
            )
        return Disagreement(member.shard, member.pod, bucket, message, buckets)
    return None
