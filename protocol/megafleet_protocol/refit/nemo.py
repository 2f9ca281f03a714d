"""The receiving side of NeMo RL's own refit collective: a fleet rank joins the world an unmodified NeMo
trainer builds with ``policy.init_collective(ip, port, world_size, train_world_size=T)`` and takes
the packed broadcasts of ``policy.broadcast_weights_for_collective()``.

Used by the engine's refit attempts (:mod:`megafleet_engine.refit_attempts`) when a refit names NeMo's
format, by the SDK's NeMo adapter (:func:`nemo_bucket_bytes`), and by tests that play NeMo's trainer
from the same description. This is NeMo's protocol, not megafleet's
(:mod:`~megafleet_protocol.refit.wire`): no session, round, manifest, verdict or done message; the
trainer's rank 0 hosts a ``TCPStore``, publishes a 128-byte NCCL unique id under one of two keys
(which one tells the trainer's generation and so its warm-up collective), and each refit is nothing
but one broadcast from world rank 0 per bucket, in the order of the refit info
(``prepare_refit_info``) both ends hold. docs/refit-protocol.md ("NeMo RL's collective") tells the
whole wire. This module holds the packed layout and :class:`NemoReceiver`; the parts it is built
from:

* **Rendezvous** (:mod:`~megafleet_protocol.refit.nemo_rendezvous`): the trainer's store, joined as
  a client counted in ``world_size``, and its unique id; :class:`NemoWorld` is importable from here
  too.
* **Warm-up and broadcasts** (:mod:`~megafleet_protocol.refit.nemo_collectives`): NCCL through
  ``torch.cuda.nccl``, or gloo on CPU.
* **Packing** (here): :func:`plan_buckets`: tensors in refit-info order, each's raw bytes back to
  back (no header, padding or alignment), a bucket closing right after the tensor that makes its
  size *strictly* exceed the target; :func:`unpack` cuts one received bucket back into tensors.
* **Checks** (:mod:`~megafleet_protocol.refit.nemo_checks`, with ``integrity: checksum``): the wire
  carries no digest, so each rank digests every bucket for the members to compare, and counts the
  non-finite values of every floating tensor it cuts out.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from torch._C import _distributed_c10d as c10d  # Store classes: torch.distributed re-exports them untyped

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import (
    deadlines,
    errors,
    nemo_checks,
    nemo_collectives,
    nemo_rendezvous,
    rendezvous_store,
    verification,
    wire,
)
from megafleet_protocol.refit.nemo_rendezvous import NemoWorld

__all__ = [
    "DEFAULT_BUFFER_MEMORY_RATIO",
    "MAX_BUCKET_BYTES",
    "NemoReceiver",
    "NemoWorld",
    "Stats",
    "TensorSpec",
    "Write",
    "check_refit_info",
    "nemo_bucket_bytes",
    "plan_buckets",
    "refit_info",
    "unpack",
]

DEFAULT_BUFFER_MEMORY_RATIO = 0.02
"""NeMo's default ``NRL_REFIT_BUFFER_MEMORY_RATIO``: the bucket target is this share of the
trainer GPU's memory (:func:`nemo_bucket_bytes`)."""
MAX_BUCKET_BYTES = 5 * 1024**3
"""NeMo caps its bucket target at 5 GiB."""


def nemo_bucket_bytes(total_memory_bytes: int, ratio: float = DEFAULT_BUFFER_MEMORY_RATIO) -> int:
    """NeMo's bucket target for a trainer GPU of ``total_memory_bytes``: ``min(int(total * ratio), 5 GiB)``.

    NeMo computes it from *its own* GPU (``torch.cuda.get_device_properties().total_memory`` and
    ``NRL_REFIT_BUFFER_MEMORY_RATIO``) unless the caller of ``broadcast_weights_for_collective``
    passes ``buffer_size_bytes``; the fleet cannot see that GPU, so its receivers take the number as
    an explicit setting and this helper documents the default (an H200: 143,771,336,704 B x 0.02 =
    2,875,426,734 B)."""
    return min(int(total_memory_bytes * ratio), MAX_BUCKET_BYTES)


# -- the refit info and the packed layout ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One entry of NeMo's refit info (``prepare_refit_info``): name, shape and dtype, in wire order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def refit_info(info: Mapping[str, tuple[Sequence[int], torch.dtype | str]]) -> list[TensorSpec]:
    """NeMo's ``{name: (shape, dtype)}`` (dtype as a ``torch.dtype`` or its name, e.g. ``"bfloat16"``)
    as specs in the mapping's order, which is the wire's order."""
    specs = []
    for name, (shape, dtype) in info.items():
        resolved = dtype if isinstance(dtype, torch.dtype) else wire.parse_dtype(dtype.removeprefix("torch."))
        dims = tuple(int(size) for size in shape)
        if any(size < 0 for size in dims):
            raise ValueError(f"{name}: negative dimension in shape {list(dims)}")
        specs.append(TensorSpec(name, dims, resolved))
    return specs


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """NeMo's bucket boundaries: specs in order, a bucket closing right after the spec that makes its
    size strictly greater than ``bucket_bytes`` (so a bucket may end exactly at the target and go on,
    and a tensor larger than the target ends its bucket); the last, partial bucket is sent if it has
    any tensor, even of zero bytes. A pure function of the ordered sizes and the target."""
    if bucket_bytes < 0:
        raise ValueError(f"bucket size {bucket_bytes} is negative")
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        current.append(spec)
        size += spec.nbytes
        if size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def unpack(bucket: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Cut a received ``uint8`` bucket into its tensors: views of it where the offset suits the
    dtype, copies where it does not (NeMo packs without alignment)."""
    expected = sum(spec.nbytes for spec in specs)
    if bucket.numel() != expected:
        raise errors.ProtocolError(f"a bucket of {bucket.numel()} bytes holds tensors of {expected} bytes")
    tensors = []
    offset = 0
    for spec in specs:
        piece = bucket.narrow(0, offset, spec.nbytes)
        offset += spec.nbytes
        if piece.storage_offset() % spec.dtype.itemsize:
            piece = piece.clone()
        tensors.append((spec.name, piece.view(spec.dtype).reshape(spec.shape)))
    return tensors


def check_refit_info(specs: Sequence[TensorSpec], required: Mapping[str, tuple[int, ...]]) -> None:
    """Raise :class:`~megafleet_protocol.refit.errors.ManifestMismatch` unless the trainer's refit
    info holds every tensor this rank needs (``required``: the sink's names and full shapes), each
    of that shape, and names no tensor twice. Tensors the rank does not hold are received and dropped."""
    problems = []
    seen: dict[str, TensorSpec] = {}
    twice: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            twice.add(spec.name)
        seen.setdefault(spec.name, spec)
    if twice:
        problems.append(f"the refit info names {len(twice)} tensors twice, e.g. {sorted(twice)[:3]}")
    absent = sorted(set(required) - set(seen))
    if absent:
        problems.append(f"the trainer's refit info lacks {len(absent)} parameters this rank holds, e.g. {absent[:3]}")
    reshaped = [
        f"{name} {list(seen[name].shape)} (expected {list(shape)})"
        for name, shape in sorted(required.items())
        if name in seen and seen[name].shape != tuple(shape)
    ]
    if reshaped:
        problems.append(f"{len(reshaped)} parameters have other shapes, e.g. {'; '.join(reshaped[:3])}")
    if problems:
        raise errors.ManifestMismatch("; ".join(problems))


# -- the unique id -----------------------------------------------------------------------------------


# -- the receiver ----------------------------------------------------------------------------------


Write = Callable[[list[tuple[str, torch.Tensor]]], int]
"""``write(tensors)``: copy one bucket's ``(name, tensor)`` pairs into the live parameters (the
tensors are views of the receive buffer, valid only during the call); returns how many it wrote.
NeMo's ``post_unpack_func``."""


@dataclasses.dataclass(frozen=True)
class Stats:
    """What one refit took in."""

    buckets: int
    bytes_received: int
    tensors_written: int
    verification: verification.Verification | None = None  # what was verified (None: not asked)


class NemoReceiver:
    """One fleet rank in NeMo's refit world: joined once (NeMo builds its world once per run and
    refits over it step after step), then :meth:`receive` per refit.

    Build with :meth:`connect`; :meth:`abort` may be called from any thread.
    """

    def __init__(
        self,
        store: c10d.Store,
        collective: nemo_collectives.Collective,
        *,
        world: nemo_rendezvous.NemoWorld,
        generation: nemo_rendezvous.Generation,
        unique_id: bytes,
    ) -> None:
        self.world = world
        self.generation = generation
        self.unique_id = unique_id
        self.refits = 0
        self.corrupt_bucket: int | None = None
        """Test only: flip the first byte of this bucket (counted from 0) as it arrives, before it is
        digested and written: a transport fault on this rank alone, which its digests must show."""
        self._store: c10d.Store | None = store  # kept open: the trainer's store counts its clients
        self._collective = collective
        self._aborted = False

    @classmethod
    def connect(
        cls,
        world: nemo_rendezvous.NemoWorld,
        *,
        backend: Literal["gloo", "nccl"],
        device: torch.device,
        deadline: deadlines.Deadline,
        aborted: threading.Event | None = None,
        generation: nemo_rendezvous.Generation | None = None,
        local_address: str | None = None,
        gloo_prefix: str = nemo_collectives.GLOO_PREFIX,
    ) -> NemoReceiver:
        """Join the trainer's world as ``world.rank``: rendezvous, build the communicator, warm up.

        ``generation`` overrides the one the store's keys tell (never needed with a trainer that
        follows NeMo's rule, see docs/refit-protocol.md); ``local_address`` is where gloo binds
        (default: the route to the trainer)."""
        store, found, unique_id = nemo_rendezvous.rendezvous(world, deadline=deadline, aborted=aborted)
        chosen = generation or found
        collective: nemo_collectives.Collective
        if backend == "gloo":
            bind = local_address or rendezvous_store.local_address_towards(world.address)
            collective = nemo_collectives.GlooCollective(
                store, world, deadline=deadline, local_address=bind, prefix=gloo_prefix
            )
        else:
            collective = nemo_collectives.NcclCollective(world, unique_id, device=device, deadline=deadline)
        receiver = cls(store, collective, world=world, generation=chosen, unique_id=unique_id)
        try:
            collective.warm_up(chosen, deadline)
        except BaseException:
            receiver.abort()
            raise
        return receiver

    def receive(
        self,
        specs: Sequence[TensorSpec],
        *,
        bucket_bytes: int,
        device: torch.device,
        write: Write,
        deadline: deadlines.Deadline,
        required: Mapping[str, tuple[int, ...]] | None = None,
        integrity: vocabulary.Integrity = "none",
    ) -> Stats:
        """Receive one refit: the buckets of ``specs`` (NeMo's refit info, in order) under the
        trainer's target ``bucket_bytes``, each unpacked and handed to ``write``.

        ``required`` (the sink's names and full shapes) is checked first: a refit info that lacks one
        or gives it another shape raises :class:`ManifestMismatch` before anything is received (the
        trainer has no way to hear it: its broadcasts then block until they time out).
        ``integrity`` ``checksum``: digest every bucket and count every floating tensor's non-finite
        values (:mod:`~megafleet_protocol.refit.nemo_checks`; :attr:`Stats.verification`); a tensor
        holding NaN or Inf raises :class:`NonFiniteWeights` once every bucket was written."""
        if required is not None:
            check_refit_info(specs, required)
        buckets = plan_buckets(specs, bucket_bytes)
        checks = nemo_checks.Checks(buckets, device) if integrity == "checksum" else None
        largest = max((sum(spec.nbytes for spec in bucket) for bucket in buckets), default=0)
        buffer = torch.empty(largest, dtype=torch.uint8, device=device)
        received = written = 0
        for index, bucket in enumerate(buckets):
            size = sum(spec.nbytes for spec in bucket)
            chunk = buffer.narrow(0, 0, size)
            what = (
                f"bucket {index + 1} of {len(buckets)} ({size} bytes, {bucket[0].name}"
                + (f" .. {bucket[-1].name}" if len(bucket) > 1 else "")
                + f"; bucket target {bucket_bytes} bytes)"
            )
            if self._aborted:
                raise errors.RefitAborted(f"the refit was aborted before {what}")
            self._collective.broadcast(chunk, deadline=deadline, what=what)
            if index == self.corrupt_bucket and size:  # test only
                chunk.narrow(0, 0, 1).bitwise_not_()
            received += size
            tensors = unpack(chunk, bucket)
            if checks is not None:
                checks.bucket(index, chunk)
                checks.tensors(tensors)
            written += write(tensors)
            if buffer.is_cuda:  # the writer's copies may run on another thread's stream: the buffer is reused next
                torch.cuda.synchronize(device)
        self.refits += 1
        outcome = checks.settle(integrity) if checks is not None else verification.Verification.unverified(integrity)
        return Stats(len(buckets), received, written, outcome)

    @property
    def closed(self) -> bool:
        """Whether :meth:`abort` or :meth:`close` ended this membership (it cannot be rebuilt)."""
        return self._aborted

    def abort(self) -> None:
        """Tear the communicator down (any thread); the receiver is unusable afterwards."""
        self._aborted = True
        self._collective.abort()

    def close(self) -> None:
        """Leave the world: abort the communicator (NeMo's world cannot shrink; the trainer's next
        refit fails, as it would with a lost vLLM worker) and drop the store client."""
        self.abort()
        self._store = None
