"""The refit wire protocol: what the trainer and the receivers say to each other, and how weights are
laid out in buckets.

Used by both ends, so there is one definition: the receiver (:mod:`megafleet_protocol.refit.receiver`)
and the trainer (:mod:`megafleet_protocol.refit.sender`). Pure data and torch views; no networking.
Control messages are small JSON documents in the trainer's rendezvous store; bulk data moves in
flat ``uint8`` buckets, every tensor starting at a multiple of :data:`ALIGNMENT` bytes, never split
across buckets; when the manifest names a ``checksum``, every bucket ends in a trailer of
:data:`TRAILER_BYTES` (its ``mf64`` digest, :mod:`~megafleet_protocol.refit.trailers`).
docs/refit-protocol.md draws one round's messages, the manifest shortcut and the trailer.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, get_args

import torch

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import digest

__all__ = [
    "ALIGNMENT",
    "CHECKSUMS",
    "GO_KEY",
    "HANDSHAKE_MAGIC",
    "MANIFEST_KEY",
    "PROTOCOL",
    "PROTOCOL_MAJOR",
    "TRAILER_BYTES",
    "TRAILER_MAGIC",
    "TRANSPORTS",
    "BucketPlan",
    "Done",
    "Go",
    "Manifest",
    "Placement",
    "Region",
    "TensorInfo",
    "Verdict",
    "done_key",
    "dtype_name",
    "pack",
    "parse_dtype",
    "plan_buckets",
    "plan_key",
    "sealed_size",
    "unpack",
    "verdict_key",
]

PROTOCOL = "megafleet-refit/1"
"""Name and version of this protocol; a manifest with another one is rejected."""
PROTOCOL_MAJOR = 1
HANDSHAKE_MAGIC = 0x4D465246  # "MFRF"
"""First element of the handshake broadcast: a receiver connected to something else fails at once."""
ALIGNMENT = 256
"""Byte alignment of every tensor in a bucket (enough for any dtype view and vectorised copies)."""

TRAILER_BYTES = 16
"""A checksummed bucket's last bytes: ``[h: u64, bucket: u32, "MFCK": u32]``, little-endian, at the
first multiple of 16 after the payload (:func:`sealed_size`); ``h`` is the payload's ``mf64``."""
TRAILER_MAGIC = int.from_bytes(b"MFCK", "little")
"""The trailer's last four bytes (``b"MFCK"``) read as a little-endian u32."""
CHECKSUMS: tuple[str, ...] = (digest.NAME,)
"""The digests this protocol knows (``Manifest.checksum``, the hellos' ``checksums``)."""

TRANSPORTS: tuple[str, ...] = get_args(vocabulary.Transport)

MANIFEST_KEY = "manifest"
GO_KEY = "go"


def verdict_key(group_rank: int) -> str:
    return f"verdict/{group_rank}"


def plan_key(group_rank: int) -> str:
    return f"plan/{group_rank}"


def done_key(group_rank: int) -> str:
    return f"done/{group_rank}"


# -- dtypes ----------------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; :class:`ValueError` for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# -- tensors and regions ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor the trainer offers: its (Hugging Face) name, full shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorInfo:
        return cls(name, tuple(tensor.shape), dtype_name(tensor.dtype))


@dataclasses.dataclass(frozen=True)
class Region:
    """A contiguous part of one tensor: the whole of it (``dim is None``), or indices
    ``[start, stop)`` along dimension ``dim`` (all of every other dimension)."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0

    @classmethod
    def whole(cls, name: str) -> Region:
        return cls(name)

    @property
    def is_whole(self) -> bool:
        return self.dim is None

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(full)
        shape = list(full)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)

    def nbytes(self, info: TensorInfo) -> int:
        return math.prod(self.shape(info.shape)) * info.itemsize

    def check(self, info: TensorInfo) -> None:
        """:class:`ValueError` unless this region lies inside ``info``'s tensor."""
        if self.name != info.name:
            raise ValueError(f"region of {self.name} checked against {info.name}")
        if self.dim is None:
            return
        if not 0 <= self.dim < len(info.shape) or not 0 <= self.start < self.stop <= info.shape[self.dim]:
            raise ValueError(f"{self} lies outside {info.name} {list(info.shape)}")

    def covers(self, dim: int, start: int, stop: int) -> bool:
        """Whether this region holds indices ``[start, stop)`` along ``dim`` (and all of the rest)."""
        return self.dim is None or (self.dim == dim and self.start <= start and stop <= self.stop)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This region of full tensor ``tensor`` (a view)."""
        if self.dim is None:
            return tensor
        return tensor.narrow(self.dim, self.start, self.stop - self.start)

    def to_json(self) -> list[Any]:
        return [self.name] if self.dim is None else [self.name, self.dim, self.start, self.stop]

    @classmethod
    def from_json(cls, value: Any) -> Region:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            return cls(value[0])
        if isinstance(value, list) and len(value) == 4 and isinstance(value[0], str):
            return cls(value[0], _int(value[1]), _int(value[2]), _int(value[3]))
        raise ValueError(f"malformed region {value!r}")


# -- buckets ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one region's bytes sit: bucket ``bucket``, from byte ``offset``."""

    region: Region
    bucket: int
    offset: int


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """Bucket sizes in bytes and every region's placement, in the order they are written."""

    sizes: tuple[int, ...]
    placements: tuple[Placement, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def largest(self) -> int:
        return max(self.sizes, default=0)

    def in_bucket(self, bucket: int) -> list[Placement]:
        return [placement for placement in self.placements if placement.bucket == bucket]

    def oversized(self, limit: int) -> list[int]:
        """Buckets larger than ``limit`` bytes that hold more than one region (a region larger than
        the limit may travel alone in a bucket of its own size)."""
        counts = [0] * len(self.sizes)
        for placement in self.placements:
            counts[placement.bucket] += 1
        return [bucket for bucket, size in enumerate(self.sizes) if size > limit and counts[bucket] > 1]

    def check(self, tensors: Mapping[str, TensorInfo], *, sealed: bool = False) -> None:
        """:class:`ValueError` unless every placement names an offered tensor, lies inside it and
        inside its bucket, and is aligned; ``sealed``: and every bucket ends in a trailer no
        placement reaches into."""
        if sealed:
            unsealed = [bucket for bucket, size in enumerate(self.sizes) if size < TRAILER_BYTES or size % 16]
            if unsealed:
                raise ValueError(f"buckets {unsealed[:3]} have no room for their digest's trailer")
        for placement in self.placements:
            info = tensors.get(placement.region.name)
            if info is None:
                raise ValueError(f"the plan places {placement.region.name}, which the manifest does not offer")
            placement.region.check(info)
            if not 0 <= placement.bucket < len(self.sizes) or placement.offset % ALIGNMENT:
                raise ValueError(f"bad placement {placement}")
            room = self.sizes[placement.bucket] - (TRAILER_BYTES if sealed else 0)
            if placement.offset + placement.region.nbytes(info) > room:
                raise ValueError(f"{placement} overruns its bucket of {self.sizes[placement.bucket]} bytes")

    def to_json(self) -> dict[str, Any]:
        return {
            "sizes": list(self.sizes),
            "placements": [[*p.region.to_json(), p.bucket, p.offset] for p in self.placements],
        }

    @classmethod
    def from_json(cls, value: Any) -> BucketPlan:
        try:
            sizes = tuple(_int(size) for size in value["sizes"])
            placements = tuple(
                Placement(Region.from_json(item[:-2]), _int(item[-2]), _int(item[-1])) for item in value["placements"]
            )
        except (KeyError, TypeError, IndexError) as error:
            raise ValueError(f"malformed bucket plan: {error!r}") from None
        return cls(sizes, placements)

    def encode(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> BucketPlan:
        try:
            return cls.from_json(json.loads(raw))
        except json.JSONDecodeError as error:
            raise ValueError(f"malformed bucket plan: {error!r}") from None


def plan_buckets(regions: Iterable[tuple[Region, int]], bucket_bytes: int, *, sealed: bool = False) -> BucketPlan:
    """Pack ``(region, nbytes)`` pairs, in order, into buckets of at most ``bucket_bytes`` bytes.

    Each region starts at a multiple of :data:`ALIGNMENT`; one larger than ``bucket_bytes`` gets a
    bucket of its own, sized to fit it. ``sealed``: every bucket's size includes its trailer
    (:func:`sealed_size`), within ``bucket_bytes`` too.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    sizes: list[int] = []
    placements: list[Placement] = []
    used = 0  # bytes used in the open bucket (the last one), or 0 when none is open
    for region, nbytes in regions:
        offset = _aligned(used)
        if not sizes or (used and _size(offset + nbytes, sealed) > bucket_bytes):
            sizes.append(0)
            offset = 0
        placements.append(Placement(region, len(sizes) - 1, offset))
        used = offset + nbytes
        sizes[-1] = _size(used, sealed)
    return BucketPlan(tuple(sizes), tuple(placements))


def sealed_size(payload_bytes: int) -> int:
    """The size of a bucket whose payload ends at ``payload_bytes``, with its trailer at the next
    multiple of 16 (aligned for the u64 digest)."""
    return -(-payload_bytes // 16) * 16 + TRAILER_BYTES


def _size(used: int, sealed: bool) -> int:
    return sealed_size(used) if sealed else used


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def pack(bucket: torch.Tensor, placement: Placement, source: torch.Tensor) -> None:
    """Copy ``placement.region`` of full tensor ``source`` into ``bucket`` at the placement's offset."""
    part = placement.region.take(source).contiguous().view(-1).view(torch.uint8)
    bucket.narrow(0, placement.offset, part.numel()).copy_(part)


def unpack(bucket: torch.Tensor, placement: Placement, info: TensorInfo) -> torch.Tensor:
    """The region ``placement`` put in ``bucket``, as a tensor of its shape and dtype (a view)."""
    shape = placement.region.shape(info.shape)
    nbytes = math.prod(shape) * info.itemsize
    return bucket.narrow(0, placement.offset, nbytes).view(info.torch_dtype).view(shape)


# -- messages --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What the trainer will send: every tensor's name, shape and dtype, the weight version, the
    transport, its bucket size, (broadcast) the bucket plan every receiver follows and the digest
    every bucket's trailer carries (``None``: no trailers; a manifest from a trainer older than
    trailers has no such field)."""

    version: int
    transport: vocabulary.Transport
    bucket_bytes: int
    tensors: tuple[TensorInfo, ...]
    buckets: BucketPlan | None = None  # broadcast only; reshard plans are per receiver
    protocol: str = PROTOCOL
    checksum: str | None = None  # one of CHECKSUMS: every bucket (both transports) ends in a trailer

    def by_name(self) -> dict[str, TensorInfo]:
        return {info.name: info for info in self.tensors}

    def encode(self) -> str:
        return json.dumps(
            {
                "protocol": self.protocol,
                "version": self.version,
                "transport": self.transport,
                "bucketBytes": self.bucket_bytes,
                "tensors": [[info.name, list(info.shape), info.dtype] for info in self.tensors],
                "buckets": None if self.buckets is None else self.buckets.to_json(),
                "checksum": self.checksum,
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> Manifest:
        """Parse and check a manifest; :class:`ValueError` says what is wrong."""
        try:
            value = json.loads(raw)
            protocol = str(value["protocol"])
            if protocol != PROTOCOL:
                raise ValueError(f"the trainer speaks {protocol!r}, this engine {PROTOCOL!r}")
            transport = value["transport"]
            if transport not in TRANSPORTS:
                raise ValueError(f"unknown transport {transport!r}")
            tensors = tuple(
                TensorInfo(str(name), tuple(_int(size) for size in shape), str(dtype))
                for name, shape, dtype in value["tensors"]
            )
            buckets = None if value["buckets"] is None else BucketPlan.from_json(value["buckets"])
            checksum = value.get("checksum")
            if checksum is not None and checksum not in CHECKSUMS:
                raise ValueError(f"the trainer's buckets carry digest {checksum!r}; this engine knows {CHECKSUMS}")
            manifest = cls(
                _int(value["version"]), transport, _int(value["bucketBytes"]), tensors, buckets, protocol, checksum
            )
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"malformed manifest: {error!r}") from None
        for info in tensors:
            parse_dtype(info.dtype)
        if len(manifest.by_name()) != len(tensors):
            raise ValueError("the manifest names a tensor twice")
        if (manifest.buckets is None) != (transport == "reshard"):
            raise ValueError("a broadcast manifest carries its bucket plan and a reshard manifest none")
        if manifest.buckets is not None:
            manifest.buckets.check(manifest.by_name(), sealed=manifest.checksum is not None)
        return manifest


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A receiver's answer to the manifest: accepted (with, for reshard, the regions it needs) or not."""

    ok: bool
    error: str = ""
    regions: tuple[Region, ...] = ()

    def encode(self) -> str:
        return json.dumps({"ok": self.ok, "error": self.error, "regions": [r.to_json() for r in self.regions]})

    @classmethod
    def decode(cls, raw: bytes | str) -> Verdict:
        try:
            value = json.loads(raw)
            return cls(bool(value["ok"]), str(value["error"]), tuple(Region.from_json(r) for r in value["regions"]))
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"malformed verdict: {error!r}") from None


@dataclasses.dataclass(frozen=True)
class Go:
    """The trainer's decision after the verdicts: send (``go``) or cancel (``reason``). ``manifest``
    names this manifest and plan (an id the trainer draws; empty: none): a receiver that completes
    the round offers it back in its next hello, and the trainer, when it sends the same manifest
    again, confirms it in its decision instead of sending the manifest."""

    go: bool
    reason: str = ""
    manifest: str = ""

    def encode(self) -> str:
        return json.dumps({"go": self.go, "reason": self.reason, "manifest": self.manifest})

    @classmethod
    def decode(cls, raw: bytes | str) -> Go:
        try:
            value = json.loads(raw)
            return cls(bool(value["go"]), str(value["reason"]), str(value.get("manifest") or ""))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise ValueError(f"malformed go message: {error!r}") from None


@dataclasses.dataclass(frozen=True)
class Done:
    """A receiver's report after the transfer: applied completely (``ok``) or the error."""

    ok: bool
    error: str = ""
    bytes_received: int = 0

    def encode(self) -> str:
        return json.dumps({"ok": self.ok, "error": self.error, "bytesReceived": self.bytes_received})

    @classmethod
    def decode(cls, raw: bytes | str) -> Done:
        try:
            value = json.loads(raw)
            return cls(bool(value["ok"]), str(value["error"]), _int(value["bytesReceived"]))
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"malformed done message: {error!r}") from None


def _int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"expected an integer, got {value!r}")
