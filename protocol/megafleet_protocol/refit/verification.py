"""What verified the bytes of one refit attempt before its weights went live: the record both receivers
fill and the engine's ``GET /v1/refit/status`` reports as ``verification``.

Filled by an engine rank's :mod:`~megafleet_protocol.refit.receiver` (the megafleet wire: every bucket's
trailer compared with the digest this rank computed, ``trainerDigest``) and by the NeMo receiver
(:mod:`~megafleet_protocol.refit.nemo`: NeMo's wire carries no digest, so each member reports its own
per-bucket digests for the operator to compare across members, ``agreement``, and the first tensor
holding NaN or Inf). Read by the engine's refit record (:mod:`megafleet_engine.refit_attempts.phases`)
and turned into :class:`megafleet_protocol.agent_api.VerificationReport` by the agent. Imports no torch.
"""

from __future__ import annotations

import dataclasses

from megafleet_protocol import vocabulary

__all__ = ["Mismatch", "Verification"]


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """The first bucket whose bytes did not match the trainer's digest."""

    bucket: int  # its index in the plan, counted from 0 (the digest's seed)
    first_tensor: str  # the first tensor placed in it


@dataclasses.dataclass(frozen=True)
class Verification:
    """What one attempt verified on this rank, and how."""

    integrity: vocabulary.Integrity  # what the request asked for
    method: vocabulary.VerificationMethod  # trainerDigest (trailers), agreement (NeMo's digests), none
    buckets: int = 0  # buckets verified (trailers compared, or digests computed)
    mismatch: Mismatch | None = None  # trainerDigest: the first bucket that did not match
    bucket_digests: tuple[str, ...] = ()  # agreement: each bucket's mf64 as 16 hex digits, in wire order
    non_finite: str | None = None  # agreement: the first tensor holding NaN or Inf

    @classmethod
    def unverified(cls, integrity: vocabulary.Integrity) -> Verification:
        """Nothing was verified (integrity none, or no wire bytes to verify)."""
        return cls(integrity, "none")
