"""What a fleet rank verifies of NeMo RL's packed broadcast, whose wire carries no digest: each bucket's
``mf64`` digest, for the operator to compare across members ("agreement": every inference rank
receives the same broadcast bytes), and the non-finite values of every floating tensor as it is cut
out of its bucket (a bucket cut at the wrong place shows as NaN or Inf).

Called by :meth:`NemoReceiver.receive <megafleet_protocol.refit.nemo.NemoReceiver.receive>` when the
refit asks for ``integrity: checksum``. Both are counted on the device, on the stream the bucket was
received on, into vectors read once after the last bucket (:meth:`Checks.settle`). Not verifiable
here: a corruption at the trainer, or one identical on every receiver, and a wrong bucket target that
cuts finite garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import digest, errors, verification

if TYPE_CHECKING:
    from megafleet_protocol.refit import nemo

__all__ = ["COUNT_CHUNK_ELEMENTS", "Checks"]

COUNT_CHUNK_ELEMENTS = 1 << 24
"""Elements per step of a non-finite count (the temporary mask stays at most 16 MiB)."""


class Checks:
    """The digests of ``buckets`` (NeMo's plan, each a list of specs) and the non-finite counts of
    their floating tensors, on ``device``."""

    def __init__(self, buckets: Sequence[Sequence[nemo.TensorSpec]], device: torch.device) -> None:
        self._digests = torch.zeros(len(buckets), dtype=torch.int64, device=device)
        self._floating = [  # (bucket, name) of each floating tensor, in wire order
            (index, spec.name)
            for index, bucket in enumerate(buckets)
            for spec in bucket
            if spec.dtype.is_floating_point
        ]
        self._slots = {name: slot for slot, (_, name) in enumerate(self._floating)}
        self._non_finite = torch.zeros(len(self._floating), dtype=torch.int64, device=device)
        self._digested = 0

    def bucket(self, index: int, chunk: torch.Tensor) -> None:
        """Digest received bucket ``index`` (``chunk``), queued on the current stream."""
        self._digests.narrow(0, index, 1).copy_(digest.digest(chunk, index).view(1))
        self._digested += 1

    def tensors(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Count the non-finite values of each floating tensor cut out of a bucket, queued on the
        current stream."""
        for name, tensor in tensors:
            slot = self._slots.get(name)
            if slot is not None:
                self._non_finite.narrow(0, slot, 1).copy_(_non_finite(tensor).view(1))

    def settle(self, integrity: vocabulary.Integrity) -> verification.Verification:
        """The outcome, read from the device once: every digest (as hex) and the first tensor holding
        NaN or Inf. Raises :class:`~megafleet_protocol.refit.errors.NonFiniteWeights` naming it, after
        the outcome is built (the error carries it)."""
        read = torch.cat([self._digests, self._non_finite]).tolist()
        digests, counts = read[: self._digests.numel()], read[self._digests.numel() :]
        first = next((slot for slot, count in enumerate(counts) if count), None)
        outcome = verification.Verification(
            integrity,
            "agreement",
            buckets=self._digested,
            bucket_digests=tuple(digest.hex_digest(int(value)) for value in digests[: self._digested]),
            non_finite=None if first is None else self._floating[first][1],
        )
        if first is not None:
            bucket, name = self._floating[first]
            raise errors.NonFiniteWeights(name, int(counts[first]), bucket, outcome=outcome)
        return outcome


def _non_finite(tensor: torch.Tensor) -> torch.Tensor:
    """How many of ``tensor``'s values are NaN or Inf (a 0-d int64 tensor on its device)."""
    flat = tensor.reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start in range(0, flat.numel(), COUNT_CHUNK_ELEMENTS):
        piece = flat.narrow(0, start, min(COUNT_CHUNK_ELEMENTS, flat.numel() - start))
        total.add_(torch.isfinite(piece).logical_not_().sum())
    return total
