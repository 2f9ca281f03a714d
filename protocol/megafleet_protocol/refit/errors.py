"""The refit errors, shared by the receiver (agent side) and the trainer SDK (:mod:`megafleet_protocol.refit.sender`).

Exception tree::

    RefitError                 any refit failure; the message says what and where
    ├── RefitTimeout           the refit's deadline passed (a bounded wait ran out, or the watchdog fired)
    ├── RefitAborted           the attempt was aborted on purpose (watchdog, ``POST /v1/refit/abort``)
    ├── ProtocolError          the peer does not speak this protocol, or sent something malformed
    ├── ManifestMismatch       receiver side: the manifest does not cover this rank's parameters
    ├── RefitRejected          trainer side: one or more receivers rejected the manifest (nothing sent)
    └── ReceiverFailed         trainer side: one or more receivers reported a failure after the transfer

Imports nothing heavy: the agent's HTTP layer imports this module at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "ManifestMismatch",
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


class RefitAborted(RefitError):
    """The attempt was aborted (watchdog or an explicit abort); its process group is torn down."""


class ProtocolError(RefitError):
    """The peer speaks another protocol version or sent a malformed message."""


class ManifestMismatch(RefitError):
    """The trainer's manifest does not give this rank a complete weight version (missing names,
    other shapes, another version or transport, buckets larger than this fleet allows)."""


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
