"""Receive one weight version from the trainer into a sink: the receiver's half of the wire protocol.

Called by a refit attempt (:mod:`megafleet_engine.refit.controller`) on its own thread, after the
engine is suspended and the communicator has joined the trainer's world, and by tests that receive
straight into a sink. :func:`receive` checks the trainer's manifest against the sink (answering
with a verdict, so a mismatch is refused before any byte moves), then takes the buckets one by one:
``broadcast`` receives every bucket of the manifest's plan (every rank gets whole tensors and keeps
what it holds), ``reshard`` receives only the buckets of the plan the trainer made for this rank
from the regions it asked for (point-to-point sends of exactly the ``Piece`` ranges of its shard
map). Each bucket is written through ``apply``, which runs the copies on the engine's backend thread.

Reshard as point-to-point from trainer rank 0 (not a scatter or an M-to-N exchange) is a deliberate
first step: it needs only the HF tensors the trainer already exports, moves exactly the bytes each
rank holds, and runs the same on gloo and NCCL. Its cost is that the trainer's rank 0 sends every
shard's bytes itself; letting every trainer rank send its own slices is the follow-up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from megafleet_engine.refit import communicator, errors, progress, sinks, wire

__all__ = ["Apply", "check_manifest", "receive"]

T = TypeVar("T")

Apply = Callable[[Callable[[], int]], int]
"""``apply(write)``: run ``write`` (copies into live tensors, returning how many it wrote) where
weights may be written (the backend thread), and return its result."""


def receive(
    comm: communicator.Communicator,
    sink: sinks.Sink,
    *,
    version: int,
    transport: wire.Transport,
    bucket_limit_bytes: int,
    apply: Apply,
    record: progress.Progress,
) -> int:
    """Receive and write one complete weight version; returns the bytes received.

    Raises :class:`~megafleet_engine.refit.errors.ManifestMismatch` (after telling the trainer) when
    the manifest does not fit this rank, and another :class:`RefitError` for any other failure.
    """
    with record.timed("join"):
        comm.handshake()
        manifest = _read_manifest(comm)
        verdict = check_manifest(
            manifest, sink, version=version, transport=transport, bucket_limit_bytes=bucket_limit_bytes
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
    record.enter("receiving")
    tensors = manifest.by_name()
    by_bucket: list[list[wire.Placement]] = [[] for _ in plan.sizes]
    for placement in plan.placements:
        by_bucket[placement.bucket].append(placement)
    buffer = torch.empty(plan.largest, dtype=torch.uint8, device=sink.device)
    for bucket, size in enumerate(plan.sizes):
        chunk = buffer.narrow(0, 0, size)
        what = f"bucket {bucket + 1} of {len(plan.sizes)}"
        with record.timed("receive"):
            if transport == "broadcast":
                comm.broadcast(chunk, what=what)
            else:
                comm.recv(chunk, src=0, tag=bucket, what=what)
        with record.timed("apply"):
            written = apply(functools.partial(_write, sink, chunk, by_bucket[bucket], tensors))
        record.count(bytes_received=size, buckets=1, tensors_written=written)
    missing = sink.missing()
    if missing:
        raise errors.RefitError(f"the transfer left {len(missing)} parameters unwritten, e.g. {missing[:3]}")
    return plan.total_bytes


def check_manifest(
    manifest: wire.Manifest,
    sink: sinks.Sink,
    *,
    version: int,
    transport: wire.Transport,
    bucket_limit_bytes: int,
) -> wire.Verdict:
    """Whether ``manifest`` gives this rank a complete ``version`` it can take; with reshard, the
    accepting verdict carries the regions this rank needs."""
    problems: list[str] = []
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
        plan.check(manifest.by_name())
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
    sink: sinks.Sink, bucket: torch.Tensor, placements: Sequence[wire.Placement], tensors: dict[str, wire.TensorInfo]
) -> int:
    written = 0
    for placement in placements:
        info = tensors[placement.region.name]
        written += sink.write(placement.region, wire.unpack(bucket, placement, info))
    return written


def _decode(parse: Callable[[bytes], T], raw: bytes, what: str) -> T:
    try:
        return parse(raw)
    except ValueError as error:
        raise errors.ProtocolError(f"the trainer's {what} is invalid: {error}") from None


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"
