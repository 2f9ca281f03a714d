"""The refit errors, shared by the receiver (agent side) and the trainer SDK (:mod:`megafleet_protocol.refit.sender`).

Exception tree::

    RefitError                 any refit failure; the message says what and where
    ├── RefitTimeout           the refit's deadline passed (a bounded wait ran out, or the watchdog fired)
    │   └── CommitExpired      receiver side: a staged copy's commit did not come within the deadline + grace
    ├── RefitAborted           the attempt was aborted on purpose (watchdog, ``POST /v1/refit/abort``)
    ├── ProtocolError          the peer does not speak this protocol, or sent something malformed
    ├── ManifestMismatch       receiver side: the manifest does not cover this rank's parameters
    ├── BucketMismatch         receiver side: a bucket's bytes do not match the trainer's digest
    ├── NonFiniteWeights       receiver side (NeMo's wire, integrity checksum): a tensor holds NaN or Inf
    ├── RefitRejected          trainer side: one or more receivers rejected the manifest (nothing sent)
    └── ReceiverFailed         trainer side: one or more receivers reported a failure after the transfer

Imports nothing heavy: the agent's HTTP layer imports this module at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megafleet_protocol.refit import verification

__all__ = [
    "BucketMismatch",
    "CommitExpired",
    "ManifestMismatch",
    "NonFiniteWeights",
    "ProtocolError",
    "ReceiverFailed",
    "RefitAborted",
    "RefitError",
    "RefitRejected",
    "RefitTimeout",
]


class RefitError(RuntimeError):
    """Base of every refit failure."""


class RefitTimeout(RefitError):
    """The refit's deadline passed before this step finished."""


class CommitExpired(RefitTimeout):
    """A staged attempt's commit (the trainer's or the operator's) did not come before its deadline
    plus its grace: the staged copy is discarded and the old version serves on."""


class RefitAborted(RefitError):
    """The attempt was aborted (watchdog or an explicit abort); its process group is torn down."""


class ProtocolError(RefitError):
    """The peer speaks another protocol version or sent a malformed message."""


class ManifestMismatch(RefitError):
    """The trainer's manifest does not give this rank a complete weight version (missing names,
    other shapes, another version or transport, buckets larger than this fleet allows)."""


class BucketMismatch(RefitError):
    """A bucket arrived with other bytes than the trainer digested (its trailer's ``mf64`` digest or
    bucket index differs from what this rank computed): the transfer corrupted it. ``bucket`` is its
    index in the plan (the digest's seed), ``first_tensor`` the name of the first tensor in it."""

    def __init__(self, bucket: int, first_tensor: str, buckets: int) -> None:
        self.bucket = bucket
        self.first_tensor = first_tensor
        super().__init__(
            f"bucket {bucket} (of {buckets}, counted from 0; first tensor {first_tensor}) does not match the "
            "trainer's mf64 digest: its bytes changed on the way"
        )


class NonFiniteWeights(RefitError):
    """A floating tensor of the version holds NaN or Inf values (counted as it was cut out of its
    bucket): on NeMo's wire, which carries no digest, the sign of a bucket cut at the wrong place.
    ``outcome``: what the receiver verified, this included."""

    def __init__(
        self, tensor: str, count: int, bucket: int, *, outcome: verification.Verification | None = None
    ) -> None:
        self.tensor = tensor
        self.count = count
        self.bucket = bucket
        self.outcome = outcome
        super().__init__(
            f"{tensor} (bucket {bucket}, counted from 0) holds {count} non-finite values: the trainer sent them, "
            "or the buckets were cut at other places than the trainer's (a wrong bucketBytes)"
        )


class _PerRank(RefitError):
    """A failure reported by some ranks of the refit world; ``reasons`` maps global rank to text."""

    def __init__(self, what: str, reasons: Mapping[int, str]) -> None:
        self.reasons = dict(reasons)
        shown = "; ".join(f"rank {rank}: {reason}" for rank, reason in sorted(self.reasons.items())[:4])
        more = f" (and {len(self.reasons) - 4} more)" if len(self.reasons) > 4 else ""
        super().__init__(f"{what}: {shown}{more}")


class RefitRejected(_PerRank):
    """Receivers rejected the manifest; no weight was sent and no receiver wrote anything."""

    def __init__(self, reasons: Mapping[int, str]) -> None:
        super().__init__("receivers rejected the manifest", reasons)


class ReceiverFailed(_PerRank):
    """Receivers failed during or after the transfer; they are stale until a later refit succeeds."""

    def __init__(self, reasons: Mapping[int, str]) -> None:
        super().__init__("receivers failed", reasons)
