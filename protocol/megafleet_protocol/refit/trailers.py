"""The digest trailer of a bucket on the megafleet wire: the trainer seals each bucket once it is packed,
and every receiver checks each bucket as it lands, before any of its weights can go live.

Called by the trainer's :mod:`~megafleet_protocol.refit.sender` (:func:`seal`, on the stream that
packed the bucket) and by an engine rank's :mod:`~megafleet_protocol.refit.receiver` (:class:`Checks`,
on the stream the bucket was received on, before the bucket is written out of its buffer). The layout
(``[h: u64, bucket: u32, "MFCK": u32]`` at :func:`wire.sealed_size <megafleet_protocol.refit.wire.sealed_size>`)
is :mod:`~megafleet_protocol.refit.wire`'s; ``h`` is :mod:`~megafleet_protocol.refit.digest`'s ``mf64``
of the payload, every byte before the trailer. Nothing waits on the host per bucket: a receiver's
comparisons land in a vector on its device, read once after the last bucket (:meth:`Checks.settle`).
"""

from __future__ import annotations

import torch

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import digest, verification, wire

__all__ = ["Checks", "seal"]


def seal(chunk: torch.Tensor, bucket: int) -> None:
    """Write bucket ``bucket``'s trailer into the last :data:`~wire.TRAILER_BYTES` of the packed
    ``chunk`` (its whole size, trailer included), queued on the current stream."""
    payload, trailer = _split(chunk)
    trailer.narrow(0, 0, 1).copy_(digest.digest(payload, bucket).view(1))
    trailer.narrow(0, 1, 1).fill_(_tag(bucket))


class Checks:
    """A receiver's comparisons of every bucket of ``plan`` with its trailer, on ``device`` (made
    before the transfer: it compiles the digest's kernel, if it was not yet)."""

    def __init__(self, plan: wire.BucketPlan, device: torch.device) -> None:
        digest.warm_up(device)
        self._first: dict[int, str] = {}
        for placement in plan.placements:
            self._first.setdefault(placement.bucket, placement.region.name)
        self._buckets = len(plan.sizes)
        self._failed = torch.zeros(self._buckets, dtype=torch.bool, device=device)
        self._checked = 0

    def check(self, bucket: int, chunk: torch.Tensor) -> None:
        """Compare received bucket ``bucket`` (``chunk``, trailer included) with its trailer, queued on
        the current stream: the digest of its payload and the bucket index must both match."""
        payload, trailer = _split(chunk)
        computed = digest.digest(payload, bucket)
        failed = torch.ne(trailer[0], computed).logical_or_(torch.ne(trailer[1], _tag(bucket)))
        self._failed.narrow(0, bucket, 1).copy_(failed.view(1))
        self._checked += 1

    def settle(self, integrity: vocabulary.Integrity) -> verification.Verification:
        """The outcome, read from the device once (after every bucket's check was queued; the host
        waits for them here): the first bucket that failed, if any."""
        failed = self._failed.nonzero().flatten().tolist()
        mismatch = None
        if failed:
            bucket = int(failed[0])
            mismatch = verification.Mismatch(bucket, self._first.get(bucket, "(none)"))
        return verification.Verification(integrity, "trainerDigest", buckets=self._checked, mismatch=mismatch)

    @property
    def buckets(self) -> int:
        return self._buckets


def _split(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sealed bucket's payload (``uint8``) and trailer (two int64 words)."""
    offset = chunk.numel() - wire.TRAILER_BYTES
    if offset < 0 or offset % 16:
        raise ValueError(f"a bucket of {chunk.numel()} bytes has no trailer")
    return chunk.narrow(0, 0, offset), chunk.narrow(0, offset, wire.TRAILER_BYTES).view(torch.int64)


def _tag(bucket: int) -> int:
    """The trailer's second word: the bucket index and the magic, as the int64 with those bits."""
    word = (bucket & 0xFFFFFFFF) | wire.TRAILER_MAGIC << 32
    return word - (1 << 64) if word >= 1 << 63 else word
