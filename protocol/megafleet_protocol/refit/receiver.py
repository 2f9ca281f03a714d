"""Receive one weight version from the trainer into a sink: the receiver's half of the wire protocol.

Called by a refit attempt (:mod:`megafleet_engine.refit_attempts.attempt`) on its own thread, while its
engine suspends (no byte is received before the suspend ended), and by tests that receive straight
into a sink. :func:`receive` checks the trainer's manifest against the sink (answering with a
verdict, so a mismatch is refused before any byte moves) unless it holds that manifest from the
last round already, then takes the buckets one by one:
``broadcast`` receives every bucket of the manifest's plan (every rank gets whole tensors and keeps
what it holds), ``reshard`` receives only the buckets of the plan the trainer made for this rank
from the regions it asked for (point-to-point sends of exactly the ``Piece`` ranges of its shard
map). Each bucket is written through ``apply``, which runs the copies on the engine's backend thread,
while the next bucket travels into a second buffer (see :func:`_transfer`: gloo overlaps through
gloo's own threads, NCCL through CUDA streams and events, with one host wait at the end). When the
trainer sealed the buckets (the manifest names a ``checksum``, which it does when every receiver
asked for one), each bucket is checked against its trailer as it lands, before it is written out of
its buffer, and the outcome is read once, after the last write: a mismatch raises
:class:`~megafleet_protocol.refit.errors.BucketMismatch` before ``receive`` returns, so the version
never goes live (:mod:`~megafleet_protocol.refit.trailers`).

Every key the receiver reads or writes lives under the round of its version
(:meth:`Communicator.open_round`), so a trainer store that serves refit after refit never mixes
them (docs/refit-protocol.md tells the round, reshard and the pipelining).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import (
    communicator,
    cuda_streams,
    digest,
    errors,
    trailers,
    transfer_group,
    verification,
    wire,
)

__all__ = ["Accepted", "Apply", "Received", "Record", "Sink", "check_manifest", "receive"]

T = TypeVar("T")

Apply = Callable[[Callable[[], int]], int]
"""``apply(write)``: run ``write`` (copies into live tensors, returning how many it wrote) where
weights may be written (the backend thread), and return its result."""


class Sink(Protocol):
    """Where received weights go: the live parameters of one engine rank (the engine's sinks)."""

    @property
    def device(self) -> torch.device:
        """Where the live tensors (and so the receive buffers) are."""
        ...

    def required(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor this rank needs some of, with its full shape."""
        ...

    def regions(self) -> list[wire.Region]:
        """The regions of those tensors this rank holds (what the reshard transport sends it)."""
        ...

    def write(self, region: wire.Region, tensor: torch.Tensor) -> int:
        """Copy what this rank holds of ``region`` (whose values ``tensor`` holds) into the live
        tensors; returns how many live targets were written."""
        ...

    def missing(self) -> list[str]:
        """Live targets not written since the sink was made (empty: the version is complete)."""
        ...

    def fresh(self) -> Sink:
        """The same sink with nothing written yet (for the next version; nothing is looked up again)."""
        ...


class Record(Protocol):
    """Where :func:`receive` records the attempt's progress (the engine's refit progress)."""

    def timed(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Add the time the block takes to timing ``name`` (``join``, ``receive``, ``apply``)."""
        ...

    def enter(self, phase: vocabulary.AttemptPhase) -> None:
        """Move to ``phase`` unless the outcome is decided."""
        ...

    def count(self, *, bytes_received: int = 0, buckets: int = 0, tensors_written: int = 0) -> None: ...

    def set_reused(self, reused: bool) -> None:
        """Whether the round kept the transfer group of the last one."""
        ...

    def verified(self, outcome: verification.Verification) -> None:
        """What verified the version's bytes (recorded before a mismatch is raised)."""
        ...


@dataclasses.dataclass(frozen=True)
class Accepted:
    """A manifest this rank accepted, with the plan it received by: the next round of the same
    session takes it again as it is when the trainer offers the same id (no manifest, verdict or go
    then), as long as this rank's transport and bucket limit are still those it was checked for."""

    id: str
    manifest: wire.Manifest
    plan: wire.BucketPlan
    transport: vocabulary.Transport
    bucket_limit_bytes: int

    def holds(self, transport: vocabulary.Transport, bucket_limit_bytes: int, checksum: str | None = None) -> bool:
        """Whether this round may take it again: the same transport and bucket limit, and buckets
        sealed with exactly the digest this rank asks for now (``None``: none)."""
        return (
            transport == self.transport
            and bucket_limit_bytes == self.bucket_limit_bytes
            and self.manifest.checksum == checksum
        )


@dataclasses.dataclass(frozen=True)
class Received:
    """What :func:`receive` took in: the bytes, and the manifest to offer the trainer next round."""

    nbytes: int
    accepted: Accepted | None


def receive(
    comm: communicator.Communicator,
    sink: Sink,
    *,
    version: int,
    transport: vocabulary.Transport,
    bucket_limit_bytes: int,
    apply: Apply,
    record: Record,
    accepted: Accepted | None = None,
    before_transfer: Callable[[], None] | None = None,
    after_writes: Callable[[], None] | None = None,
    integrity: vocabulary.Integrity = "none",
) -> Received:
    """Receive and write one complete weight version.

    Opens the round of ``version`` on ``comm`` first (keeping its group or joining a new one),
    offering ``accepted`` (the last round's :attr:`Received.accepted`): when the trainer confirms it
    sends the same manifest, nothing more is exchanged before the buckets. ``before_transfer`` runs
    once the round is agreed, before the first byte is received or written (the caller waits for
    its engine's suspend there); ``after_writes`` runs once every write was issued and the sink is
    complete, before the wait for the device to finish them (the caller checks there, off the
    critical path, that nothing was rebound). Raises
    :class:`~megafleet_protocol.refit.errors.ManifestMismatch` (after answering the trainer with the
    refusing verdict) when the manifest does not fit this rank, and another :class:`RefitError` for
    any other failure.

    ``integrity`` ``checksum``: ask the trainer to seal every bucket with its ``mf64`` digest; a
    manifest without digests is refused (:class:`ManifestMismatch`), and a bucket that does not match
    its trailer raises :class:`~megafleet_protocol.refit.errors.BucketMismatch` naming it and its first
    tensor, after its writes were issued but before this returns. ``record.verified`` learns what was
    verified either way.
    """
    asked = digest.NAME if integrity == "checksum" else None
    offer = accepted if accepted is not None and accepted.holds(transport, bucket_limit_bytes, asked) else None
    with record.timed("join"):
        held = offer.id if offer is not None else None
        record.set_reused(comm.open_round(version, manifest=held, checksums=(asked,) if asked else ()))
        if offer is not None and comm.held_manifest == offer.id:
            manifest, plan = offer.manifest, offer.plan
        else:
            manifest, plan, offer = _agree(comm, sink, version, transport, (bucket_limit_bytes, integrity))
        checks = trailers.Checks(plan, _buffer_device(comm, sink)) if manifest.checksum is not None else None
    if before_transfer is not None:
        before_transfer()
    record.enter("receiving")

    def issued() -> None:
        missing = sink.missing()
        if missing:
            raise errors.RefitError(f"the transfer left {len(missing)} parameters unwritten, e.g. {missing[:3]}")
        if after_writes is not None:
            after_writes()

    _transfer(_Round(comm, sink, plan, transport, manifest.by_name(), apply, record, checks), issued)
    outcome = checks.settle(integrity) if checks is not None else verification.Verification.unverified(integrity)
    record.verified(outcome)
    if outcome.mismatch is not None:
        raise errors.BucketMismatch(outcome.mismatch.bucket, outcome.mismatch.first_tensor, len(plan.sizes))
    return Received(plan.total_bytes, offer)


def _agree(
    comm: communicator.Communicator,
    sink: Sink,
    version: int,
    transport: vocabulary.Transport,
    limits: tuple[int, vocabulary.Integrity],
) -> tuple[wire.Manifest, wire.BucketPlan, Accepted | None]:
    """Read the manifest, answer it, and read the trainer's go (and, reshard, this rank's plan);
    ``limits``: this rank's bucket limit in bytes and its integrity."""
    bucket_limit_bytes, integrity = limits
    manifest = _read_manifest(comm)
    verdict = check_manifest(
        manifest,
        sink,
        version=version,
        transport=transport,
        bucket_limit_bytes=bucket_limit_bytes,
        integrity=integrity,
    )
    comm.set(wire.verdict_key(comm.group_rank), verdict.encode())
    if not verdict.ok:
        raise errors.ManifestMismatch(verdict.error)
    go = _decode(wire.Go.decode, comm.get(wire.GO_KEY, what="the trainer's go"), "go")
    if not go.go:
        raise errors.RefitError(f"the trainer cancelled the transfer: {go.reason}")
    if manifest.buckets is not None:
        plan = manifest.buckets
    else:
        plan = _read_plan(comm, manifest, verdict.regions, bucket_limit_bytes)
    accepted = Accepted(go.manifest, manifest, plan, transport, bucket_limit_bytes) if go.manifest else None
    return manifest, plan, accepted


@dataclasses.dataclass(frozen=True)
class _Round:
    """What one round's transfer works with: the agreed plan, where its bytes come from and go, and
    the checks of its trailers (``None``: the buckets are not sealed)."""

    comm: communicator.Communicator
    sink: Sink
    plan: wire.BucketPlan
    transport: vocabulary.Transport
    tensors: dict[str, wire.TensorInfo]
    apply: Apply
    record: Record
    checks: trailers.Checks | None


def _transfer(round_: _Round, issued: Callable[[], None]) -> None:
    """Receive the buckets of the round's plan into two alternating buffers and write each through
    ``apply`` while the next one travels; ``issued`` runs once every write was issued, before the
    host waits for the device (NCCL) to finish them.

    Gloo: the next bucket's op runs on gloo's threads while this thread checks the bucket's trailer
    and waits for the backend thread's writes. NCCL: nothing waits on the host per bucket; the
    trailer's check and the writes run on a side stream that waits for each bucket's op, a buffer is
    received into again only after the side stream checked it and wrote it out (an event on the
    receiving thread's stream, which NCCL's stream follows), and the host waits once, for the last
    write. Writes stay ``copy_`` into the live tensors.
    """
    comm, sink, plan, record, checks = round_.comm, round_.sink, round_.plan, round_.record, round_.checks
    count = len(plan.sizes)
    if count == 0:
        issued()
        return
    by_bucket: list[list[wire.Placement]] = [[] for _ in plan.sizes]
    for placement in plan.placements:
        by_bucket[placement.bucket].append(placement)
    device = _buffer_device(comm, sink)
    stream = cuda_streams.side_stream(device)
    slots = min(2, count)
    pinned = device.type == "cpu" and sink.device.type == "cuda"  # gloo into a GPU engine: host buffers
    buffers = [torch.empty(plan.largest, dtype=torch.uint8, device=device, pin_memory=pinned) for _ in range(slots)]
    if stream is not None:
        for buffer in buffers:
            buffer.record_stream(stream)  # the allocator keeps them until the side stream is done with them
    written: list[torch.cuda.Event | None] = [None] * slots  # NCCL: the writes out of each buffer are done
    received: torch.cuda.Event | None = None

    def chunk(bucket: int) -> torch.Tensor:
        return buffers[bucket % slots].narrow(0, 0, plan.sizes[bucket])

    def start(bucket: int) -> transfer_group.Pending:
        event = written[bucket % slots]
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        what = f"bucket {bucket + 1} of {count}"
        if round_.transport == "broadcast":
            return comm.start_broadcast(chunk(bucket), what=what)
        return comm.start_recv(chunk(bucket), src=0, tag=bucket, what=what)

    pending = start(0)
    for bucket in range(count):
        with record.timed("receive"):
            comm.finish(pending, stream=stream)  # gloo: the bucket is here; NCCL: the side stream waits for it
        if stream is not None:
            received = cuda_streams.new_event()
            received.record(stream)
        if bucket + 1 < count:
            pending = start(bucket + 1)  # travels while this bucket is checked and written
        done = cuda_streams.new_event() if stream is not None else None
        with record.timed("apply"):
            if checks is not None:
                with cuda_streams.on_stream(stream):
                    checks.check(bucket, chunk(bucket))  # before the write's event: the buffer waits for both
            count_written = round_.apply(
                functools.partial(_write, sink, chunk(bucket), by_bucket[bucket], round_.tensors, stream, done)
            )
        written[bucket % slots] = done
        record.count(bytes_received=plan.sizes[bucket], buckets=1, tensors_written=count_written)
    issued()
    last = written[(count - 1) % slots]
    if received is not None and last is not None:
        with record.timed("receive"):
            comm.wait_event(received, what="the last bucket")
        with record.timed("apply"):
            comm.wait_event(last, what="writing the last bucket")


def _buffer_device(comm: communicator.Communicator, sink: Sink) -> torch.device:
    """Where the buckets land: the sink's device, except gloo into a GPU engine, which moves bytes
    through host memory (the writes then copy each bucket to the GPU)."""
    return torch.device("cpu") if comm.backend == "gloo" else sink.device


def check_manifest(
    manifest: wire.Manifest,
    sink: Sink,
    *,
    version: int,
    transport: vocabulary.Transport,
    bucket_limit_bytes: int,
    integrity: vocabulary.Integrity = "none",
) -> wire.Verdict:
    """Whether ``manifest`` gives this rank a complete ``version`` it can take (``integrity``
    ``checksum``: in buckets sealed with a digest); with reshard, the accepting verdict carries the
    regions this rank needs."""
    problems: list[str] = []
    if integrity == "checksum" and manifest.checksum is None:
        problems.append(
            "this refit asks for integrity checksum, but the trainer's buckets carry no digest (its SDK is "
            "older than digests, it was built with integrity none, or another receiver did not ask for them)"
        )
    if manifest.version != version:
        problems.append(f"the trainer sends weight version {manifest.version}, this engine expects {version}")
    if manifest.transport != transport:
        problems.append(f"the trainer uses the {manifest.transport} transport, this fleet {transport}")
    if manifest.bucket_bytes > bucket_limit_bytes or (
        manifest.buckets and manifest.buckets.oversized(bucket_limit_bytes)
    ):
        problems.append(
            f"the trainer's buckets ({_mib(manifest.bucket_bytes)}) exceed this fleet's bucket size "
            f"({_mib(bucket_limit_bytes)}; spec.refit.bucketSizeMiB)"
        )
    offered = manifest.by_name()
    required = sink.required()
    absent = sorted(set(required) - set(offered))
    if absent:
        problems.append(f"the manifest lacks {len(absent)} parameters this rank holds, e.g. {absent[:3]}")
    reshaped = [
        f"{name} {list(offered[name].shape)} (expected {list(shape)})"
        for name, shape in sorted(required.items())
        if name in offered and offered[name].shape != shape
    ]
    if reshaped:
        problems.append(f"{len(reshaped)} parameters have other shapes, e.g. {'; '.join(reshaped[:3])}")
    if problems:
        return wire.Verdict(ok=False, error="; ".join(problems))
    regions = tuple(sink.regions()) if transport == "reshard" else ()
    return wire.Verdict(ok=True, regions=regions)


def _read_manifest(comm: communicator.Communicator) -> wire.Manifest:
    return _decode(wire.Manifest.decode, comm.get(wire.MANIFEST_KEY, what="the trainer's manifest"), "manifest")


def _read_plan(
    comm: communicator.Communicator,
    manifest: wire.Manifest,
    requested: Sequence[wire.Region],
    bucket_limit_bytes: int,
) -> wire.BucketPlan:
    """This rank's reshard plan: exactly the regions it asked for, inside the manifest's tensors."""
    raw = comm.get(wire.plan_key(comm.group_rank), what="the trainer's reshard plan")
    plan = _decode(wire.BucketPlan.decode, raw, "reshard plan")
    try:
        plan.check(manifest.by_name(), sealed=manifest.checksum is not None)
    except ValueError as error:
        raise errors.ProtocolError(f"the trainer's reshard plan is invalid: {error}") from None
    placed = [placement.region for placement in plan.placements]
    if sorted(placed, key=repr) != sorted(requested, key=repr):
        raise errors.ProtocolError("the trainer's reshard plan does not hold exactly the regions this rank asked for")
    oversized = plan.oversized(bucket_limit_bytes)
    if oversized:
        raise errors.ProtocolError(f"reshard buckets {oversized} exceed this fleet's bucket size")
    return plan


def _write(
    sink: Sink,
    bucket: torch.Tensor,
    placements: Sequence[wire.Placement],
    tensors: dict[str, wire.TensorInfo],
    stream: torch.cuda.Stream | None,
    done: torch.cuda.Event | None,
) -> int:
    """Write one received bucket into the sink (on the backend thread), on ``stream`` when given,
    and record ``done`` there after the last copy."""
    written = 0
    with cuda_streams.on_stream(stream):
        for placement in placements:
            info = tensors[placement.region.name]
            written += sink.write(placement.region, wire.unpack(bucket, placement, info))
        if done is not None:
            done.record()
    return written


def _decode(parse: Callable[[bytes], T], raw: bytes, what: str) -> T:
    try:
        return parse(raw)
    except ValueError as error:
        raise errors.ProtocolError(f"the trainer's {what} is invalid: {error}") from None


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"
