"""Whether the members of a Refit hold the same bytes where no wire digest verifies them: a pure
comparison of their digests, under table tests.

* NeMo RL's collective carries no digest, but every inference rank receives the same broadcast bytes
  (docs/refit-protocol.md, "NeMo RL's collective"), so each member pod reports the digest of every
  bucket it received (``verification.bucketDigests``) and *every* member must agree.
* After megatron-core's swap or a checkpoint load each rank digests its own parameters
  (:mod:`megafleet_protocol.refit.parameter_digests`); a pod reports its ranks' lists one after
  another. Ranks of one shard hold different slices, but the pod at the same position of every shard
  holds the same TP/PP ranks (the shards are data-parallel replicas), so the pods are compared *by
  position*: the first pod of every shard with each other, the second with each other, and so on.

Called by :func:`.attempts.collect` before the operator's commit (staged members) or once every
member reported succeeded (in place: they have switched already): a member in the minority fails the
Refit ``DigestDisagreement`` naming it and the bucket (or group); with no majority the Refit fails too,
naming the first member that differs from the most common digest. One shard alone has nothing to be
compared with.
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
    """The first bucket (in transfer order) whose digest is not the same on every member that must
    hold the same bytes (:func:`replicas`), or None when they all agree (or no two reported any:
    nothing to compare). A member that reported fewer buckets than another disagrees on the missing
    ones. ``reports`` come in pod order within each shard."""
    for group in replicas(reports):
        found = _disagreement(group)
        if found is not None:
            return found
    return None


def replicas(
    reports: Sequence[member_reports.MemberReport],
) -> list[list[tuple[member_reports.MemberReport, Sequence[str]]]]:
    """The members that reported digests, grouped by what must be equal: all of NeMo's broadcast
    together; the others (each rank digested its own parameters) by the pod's position in its shard."""
    positions: dict[int, int] = {}
    groups: dict[int | None, list[tuple[member_reports.MemberReport, Sequence[str]]]] = {}
    for member in reports:
        position = positions.get(member.shard, 0)
        positions[member.shard] = position + 1
        report = member.report
        if report.verification is None or not report.verification.bucket_digests:
            continue
        per_rank = report.source == "checkpoint" or report.transport == "reshard"
        groups.setdefault(position if per_rank else None, []).append((member, report.verification.bucket_digests))
    return [group for _, group in sorted(groups.items(), key=lambda item: -1 if item[0] is None else item[0])]


def _disagreement(digests: Sequence[tuple[member_reports.MemberReport, Sequence[str]]]) -> Disagreement | None:
    """The first bucket the members of one replica group disagree on, or None."""
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
