"""``mf64`` over one engine rank's parameters after a refit wrote them, where no wire carries a digest the
rank could check: megatron-core's own swap (megatron-native) and a checkpoint every shard loads itself.
Each rank reports these digests (``verification.bucketDigests``, method ``agreement``) and the operator
compares the replicas that must hold the same bytes: the pods at the same position of every shard
(data-parallel replicas of the same TP/PP ranks). Backend-agnostic: it takes the rank's tensors by name
(the backend's ``parameters()``, or its staging copy), on whatever device they live.

The definition. The rank's tensors, **sorted by name**, are laid out back to back, each starting at a
multiple of 8 bytes (zero padding between), and cut into *groups* (:func:`plan_groups`): a group closes
before the tensor that would take it past ``group_bytes``; a tensor larger than that is a group of its
own. A group's digest is ``mf64`` (:mod:`~megafleet_protocol.refit.digest`) of its bytes with the
group's index as seed, exactly as if the group were one bucket. It is computed tensor by tensor,
never copied together: the digest of a range that starts at word ``o`` of the group is the digest of
that range alone with the seed :func:`~megafleet_protocol.refit.digest.seed_at` ``(group, o)``, and the
ranges' digests add up (mod 2**64). On CUDA each range goes through the Triton kernel when Triton is
installed (else chunked torch), queued on the current stream; the digests are read from the device
once, after the last one.

Called by the engine's refit sources (:mod:`megafleet_engine.refit_attempts.sources.megatron_swap`,
:mod:`~megafleet_engine.refit_attempts.sources.checkpoint`) when the refit asks for
``integrity: checksum``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import digest, verification

__all__ = ["ALIGNMENT", "GROUP_BYTES", "Placed", "digest_tensors", "plan_groups", "reference"]

GROUP_BYTES = 1 << 30
"""The default group size (1 GiB): an 8B model's rank reports a few dozen digests at most."""
ALIGNMENT = 8
"""Every tensor starts at a multiple of this many bytes of its group (one ``mf64`` word)."""


@dataclasses.dataclass(frozen=True)
class Placed:
    """One tensor in its group: where its bytes start (a multiple of :data:`ALIGNMENT`) and how many."""

    name: str
    offset: int
    nbytes: int


def plan_groups(sizes: Sequence[tuple[str, int]], group_bytes: int = GROUP_BYTES) -> list[list[Placed]]:
    """The groups of tensors of ``sizes`` (``(name, nbytes)``, in any order): sorted by name, each
    tensor at the next multiple of :data:`ALIGNMENT`, a group closing before the tensor that would end
    past ``group_bytes`` (a larger tensor opens and closes a group of its own). A pure function."""
    if group_bytes < 1:
        raise ValueError(f"group size {group_bytes} must be positive")
    groups: list[list[Placed]] = []
    current: list[Placed] = []
    end = 0
    for name, nbytes in sorted(sizes):
        start = -(-end // ALIGNMENT) * ALIGNMENT
        if current and start + nbytes > group_bytes:
            groups.append(current)
            current, start = [], 0
        current.append(Placed(name, start, nbytes))
        end = start + nbytes
    if current:
        groups.append(current)
    return groups


def digest_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    integrity: vocabulary.Integrity = "checksum",
    group_bytes: int = GROUP_BYTES,
) -> verification.Verification:
    """The ``mf64`` digest of every group of ``tensors`` (:func:`plan_groups`), as the refit status
    reports them: method ``agreement``, one digest per group in group order. Waits for the device's
    streams first (a refit's copies may have run on others) and reads the digests once."""
    flat = {name: _bytes(tensor) for name, tensor in tensors.items()}
    groups = plan_groups([(name, data.numel()) for name, data in flat.items()], group_bytes)
    if not groups:
        return verification.Verification(integrity, "agreement")
    device = next(iter(flat.values())).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    sums = torch.zeros(len(groups), dtype=torch.int64, device=device)
    for index, group in enumerate(groups):
        for placed in group:
            part = digest.digest(flat[placed.name], digest.seed_at(index, placed.offset // ALIGNMENT))
            sums.narrow(0, index, 1).add_(part.view(1))
    read = sums.tolist()
    return verification.Verification(
        integrity, "agreement", buckets=len(groups), bucket_digests=tuple(digest.hex_digest(int(one)) for one in read)
    )


def reference(tensors: Mapping[str, torch.Tensor], group_bytes: int = GROUP_BYTES) -> list[str]:
    """What :func:`digest_tensors` reports, by the definition on the host (the tests' reference): each
    group's tensors copied to their offsets in a zeroed buffer, numpy's ``mf64`` of it whole."""
    raw = {
        name: tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for name, tensor in tensors.items()
    }
    found = []
    for index, group in enumerate(plan_groups([(name, len(data)) for name, data in raw.items()], group_bytes)):
        buffer = bytearray(group[-1].offset + group[-1].nbytes)
        for placed in group:
            buffer[placed.offset : placed.offset + placed.nbytes] = raw[placed.name]
        found.append(digest.hex_digest(digest.reference(bytes(buffer), index)))
    return found


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a 1-D ``uint8`` tensor: a view when it is contiguous, else a contiguous
    copy (a strided view of a fused tensor, as the megatron backend shows some parameters)."""
    data = tensor.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    return data.reshape(-1).view(torch.uint8)
