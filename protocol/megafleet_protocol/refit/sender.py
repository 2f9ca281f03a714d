"""The trainer's end of a refit: send weight versions to every live shard of a fleet.

Called on the trainer's rank 0 once per refit attempt, by the SDK (:mod:`megafleet.sdk.weights`, the
NeMo RL adapter) or directly. :class:`WeightSender` holds the rendezvous store and the transfer group
across versions (NeMo RL's ``init_collective`` once, ``update_weights_from_collective`` per step);
:meth:`WeightSender.send` sends one version and returns once every receiver's engine serves it.
docs/refit-protocol.md ("The trainer's side") shows the calls and the retry rules.

Invariants: a sender sends each version once; a failed :meth:`WeightSender.send` leaves it unusable
(the retry is a new attempt on its own port); a receiver that rejects the manifest fails the send
before any byte moves (:class:`~megafleet_protocol.refit.errors.RefitRejected`); tensors given one at
a time with ``shapes=`` are read only when their bucket is packed; every bucket is sealed with its
``mf64`` digest (:mod:`~megafleet_protocol.refit.trailers`) when every receiver asked for it. The
receiver's half is :mod:`megafleet_protocol.refit.receiver`.
"""

from __future__ import annotations

import dataclasses
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType

import torch
import torch.distributed as dist

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import (
    commit_round,
    communicator,
    cuda_streams,
    deadlines,
    digest,
    errors,
    rendezvous_store,
    round_messages,
    trailers,
    transfer_group,
    wire,
)

__all__ = ["SendReport", "WeightSender"]

MIB = 2**20
_OfferKey = tuple[tuple[wire.TensorInfo, ...], int, vocabulary.Transport, str | None]
"""What makes two sends' manifests the same: every tensor's name, shape and dtype, bucket size,
transport and the buckets' digest."""


@dataclasses.dataclass(frozen=True)
class SendReport:
    """What one :meth:`WeightSender.send` did."""

    version: int
    transport: vocabulary.Transport
    tensors: int
    buckets: int  # buckets sent (reshard: summed over receivers)
    bytes_sent: int
    receivers: int
    seconds: float
    phases: dict[str, float]  # "join" (round opened), "verdicts" (manifest to go), "transfer", "acknowledgements"
    reused: bool = False  # the transfer group of the previous send was kept (no group built)
    manifest_sent: bool = True  # False: every receiver held this manifest from the last send (none was sent)
    verified: bool = False  # every bucket carried its mf64 digest, which every receiver checked


class WeightSender:
    """Trainer rank 0 of the trainer+fleet world of a refit attempt, and of the following Refits'
    first attempts while the port and world size stay the same.

    Args:
        rendezvous_port: the port this attempt's store listens on (see :func:`megafleet_protocol.ports.attempt_port`).
        world_size: trainer ranks plus every live shard's ranks (the Refit's membership).
        rank: this trainer rank; protocol 1 sends from rank 0 only (other trainer ranks take no part).
        backend: ``gloo`` (CPU tensors travel) or ``nccl`` (GPU), as the fleet's engines use.
        address: this pod's address, where the store and the transport listen (the Refit's
            ``spec.source.rendezvous.address``); default: the address this host's name resolves to.
        trainer_world_size: trainer ranks (the fleet's ranks start after them).
        timeout_seconds: bound of :meth:`init` and of each :meth:`send`.
        device: where buckets are staged; default ``cpu`` for gloo, the current CUDA device for NCCL.
        integrity: ``checksum`` (default): seal every bucket with its ``mf64`` digest when every
            receiver asks for it in its hello (engines whose refit asks for ``integrity: checksum``);
            ``none``: never (a receiver that requires digests then rejects the manifest).
        corrupt_bucket: test only: flip one byte of this bucket (its first payload byte) after its
            digest was taken, so tests can prove that receivers catch and name a corrupt bucket.
        corrupt_receiver: test only, with ``corrupt_bucket`` and the reshard transport: flip the byte in
            the buckets of this group rank only (one shard's bucket is corrupt, the others' are not).
        withhold_commit: test only: after the buckets, fail as a trainer that dies before its commit
            would (receivers waiting for it stay on their version and give their staged copy up).
    """

    def __init__(
        self,
        rendezvous_port: int,
        world_size: int,
        rank: int = 0,
        backend: vocabulary.CollectiveBackend = "gloo",
        *,
        address: str | None = None,
        trainer_world_size: int = 1,
        timeout_seconds: float = 300.0,
        device: torch.device | str | None = None,
        integrity: vocabulary.Integrity = "checksum",
        corrupt_bucket: int | None = None,  # test only
        corrupt_receiver: int | None = None,  # test only
        withhold_commit: bool = False,  # test only
    ) -> None:
        if rank != 0:
            raise ValueError(f"trainer rank {rank} sends nothing in protocol 1; only trainer rank 0 runs a sender")
        self.address = address or socket.gethostbyname(socket.gethostname())
        self.rendezvous = rendezvous_store.Rendezvous(self.address, rendezvous_port, world_size, trainer_world_size)
        self.backend = backend
        self.timeout_seconds = timeout_seconds
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self._comm: communicator.Communicator | None = None
        self._aborted = threading.Event()
        self._versions: set[int] = set()
        self._failed = False
        self._last_round: tuple[str, list[str]] | None = None  # namespace and keys of the last send
        self._offer: _Offer | None = None  # the last send's manifest, which every receiver holds
        self.integrity = integrity
        self._corrupt_bucket = corrupt_bucket
        self._withhold_commit = withhold_commit
        self._corrupt_receiver = corrupt_receiver

    @property
    def usable(self) -> bool:
        """Open, not aborted, and no send failed: it can send the next version."""
        return self._comm is not None and not self._failed and not self._aborted.is_set()

    @property
    def receivers(self) -> int:
        """Fleet ranks that receive."""
        return self.rendezvous.group_size - 1

    def init(self) -> None:
        """Start the store (listening on ``address:port``) and publish a new session id; returns at
        once. The transfer group is built by the first :meth:`send`, once every fleet rank joined."""
        if self._comm is not None:
            raise RuntimeError("init() was already called")
        self._comm = communicator.Communicator.connect(
            self.rendezvous,
            global_rank=0,
            backend=self.backend,
            device=self.device,
            deadline=deadlines.Deadline(self.timeout_seconds),
            local_address=self.address,
            aborted=self._aborted,
        )

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_size_mib: int = 1024,
        *,
        version: int,
        transport: vocabulary.Transport = "broadcast",
        shapes: Mapping[str, tuple[Sequence[int], torch.dtype]] | None = None,
    ) -> SendReport:
        """Send ``named_tensors`` (HF names, full tensors) as weight version ``version``.

        ``shapes`` (broadcast only): every tensor's name, shape and dtype, in the order
        ``named_tensors`` yields them. With it, ``named_tensors`` may be a generator that produces
        the tensors one at a time (e.g. gathered from the trainer's TP/PP shards): each is read only
        when its bucket is packed, and may be freed or reused once the generator is asked for the
        next, so the trainer never holds more than its current tensor and two staging buckets. A
        tensor out of order, of another shape or dtype, or one too many fails the send before the
        last bucket goes (the receivers then fail too and stay on their version).

        Call again for the next version (same port and world size: the next Refit's first attempt);
        each version once per sender. A failure leaves the sender unusable (:attr:`usable`): close
        it; a retry is a new attempt on a fresh port with a new sender."""
        comm = self._comm
        if comm is None:
            raise RuntimeError("call init() before send()")
        if self._failed:
            raise RuntimeError("an earlier send() failed; this sender is unusable: close it and open a new one")
        if version in self._versions:
            raise ValueError(f"weight version {version} was already sent by this sender; each version goes once")
        source: _Held | _Streamed
        if shapes is None:
            source = _Held(_collect(named_tensors))
        else:
            if transport != "broadcast":
                raise ValueError("tensors produced one at a time (shapes=...) go with the broadcast transport only")
            source = _Streamed(iter(named_tensors), _infos(shapes))
        self._versions.add(version)
        comm.deadline = deadlines.Deadline(self.timeout_seconds)
        try:
            return self._send(comm, source, bucket_size_mib, version, transport)
        except BaseException:
            self._failed = True
            comm.abort()  # never reused: the receivers' side failed too, or will see the group torn down
            raise

    def _send(
        self,
        comm: communicator.Communicator,
        source: _Held | _Streamed,
        bucket_size_mib: int,
        version: int,
        transport: vocabulary.Transport,
    ) -> SendReport:
        started = time.monotonic()
        infos = source.infos
        offer = self._offer
        if offer is not None and offer.key[:3] != (infos, bucket_size_mib * MIB, transport):
            offer = None
        reused = comm.open_round(version, manifest=offer.id if offer is not None else None)
        exchanged = offer is None or comm.held_manifest != offer.id
        key = (infos, bucket_size_mib * MIB, transport, self._checksum(comm))
        if not exchanged and offer is not None and offer.key != key:
            raise errors.ProtocolError("the receivers hold a manifest whose digests differ from those they ask for")
        last_round, self._last_round = self._last_round, (comm.namespace, self._round_keys(transport, exchanged))
        joined = time.monotonic()
        if offer is None or exchanged:
            offer = self._exchange(comm, key, version)
        agreed = time.monotonic()

        def meanwhile() -> None:  # while the buckets travel: the last round's messages are not needed
            if last_round is not None:
                comm.delete(last_round[1], namespace=last_round[0])

        broadcast_plan = offer.manifest.buckets
        sealed = offer.manifest.checksum is not None
        if broadcast_plan is not None:
            buckets = self._broadcast(comm, broadcast_plan, source, meanwhile, sealed=sealed)
            sent = broadcast_plan.total_bytes
        else:
            assert isinstance(source, _Held)  # send() allows a stream with broadcast only
            buckets = self._scatter(comm, offer.plans, source.tensors, meanwhile, sealed=sealed)
            sent = sum(plan.total_bytes for plan in offer.plans.values())
        transferred = time.monotonic()
        if comm.commit_ranks:  # receivers that staged wait for this trainer's commit before they switch
            if self._withhold_commit:
                raise errors.RefitAborted("test: the trainer withheld its commit")
            commit_round.decide(comm, comm.commit_ranks)
        self._acknowledgements(comm)
        finished = time.monotonic()
        self._offer = offer
        return SendReport(
            version=version,
            transport=transport,
            tensors=len(infos),
            buckets=buckets,
            bytes_sent=sent,
            receivers=self.receivers,
            seconds=finished - started,
            phases={
                "join": joined - started,
                "verdicts": agreed - joined,  # zero when every receiver held the manifest
                "transfer": transferred - agreed,
                "acknowledgements": finished - transferred,
            },
            reused=reused,
            manifest_sent=exchanged,
            verified=offer.manifest.checksum is not None,
        )

    def _checksum(self, comm: communicator.Communicator) -> str | None:
        """The digest this round's buckets carry: ``mf64`` when this sender seals and every receiver
        asked for it (a receiver older than digests asks for none: its buckets go unsealed)."""
        if self.integrity == "checksum" and digest.NAME in comm.asked_checksums:
            return digest.NAME
        return None

    def _exchange(self, comm: communicator.Communicator, key: _OfferKey, version: int) -> _Offer:
        """Publish the manifest, read every verdict and publish go: the manifest under a new id."""
        infos, bucket_bytes, transport, checksum = key
        broadcast_plan = None
        if transport == "broadcast":
            broadcast_plan = wire.plan_buckets(
                ((wire.Region.whole(i.name), _nbytes(i)) for i in infos), bucket_bytes, sealed=checksum is not None
            )
        manifest = wire.Manifest(version, transport, bucket_bytes, infos, broadcast_plan, checksum=checksum)
        if checksum is not None:
            digest.warm_up(self.device)  # its kernel compiles once, here rather than in the transfer
        comm.set(wire.MANIFEST_KEY, manifest.encode())
        manifest_id = secrets.token_hex(8)
        return _Offer(key, manifest_id, manifest, self._agree(comm, manifest, manifest_id))

    def _round_keys(self, transport: vocabulary.Transport, exchanged: bool) -> list[str]:
        """The keys a round writes (deleted during the next round's transfer: every receiver is
        done with them by then, and a store that serves refit after refit does not grow)."""
        receivers = range(1, self.rendezvous.group_size)
        keys = [round_messages.GROUP_KEY] + [round_messages.hello_key(r) for r in receivers]
        keys += [wire.done_key(r) for r in receivers] + [commit_round.staged_key(r) for r in receivers]
        keys.append(commit_round.COMMIT_KEY)
        if exchanged:
            keys += [wire.MANIFEST_KEY, wire.GO_KEY] + [wire.verdict_key(r) for r in receivers]
            if transport == "reshard":
                keys += [wire.plan_key(r) for r in receivers]
        return keys

    def abort(self) -> None:
        """Give this attempt up from another thread (safe at any time, idempotent): the operator
        published a newer attempt (``status.attempts`` moved on) because a member shard died. A
        :meth:`init` or :meth:`send` blocked on a peer that is gone raises
        :class:`~megafleet_protocol.refit.errors.RefitAborted` (a wait for a store key within about a
        second; a gloo collective when its peer's connection closes or at the deadline); then
        :meth:`close` it and start the next attempt on its own port with a new sender. An aborted
        sender is never used again."""
        self._aborted.set()
        comm = self._comm
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        """Release the group and stop the store (receivers have read everything they need by the
        time :meth:`send` returns; a receiver that parked the group closes it at its next refit)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    # -- steps of send -------------------------------------------------------------------------

    def _agree(
        self, comm: communicator.Communicator, manifest: wire.Manifest, manifest_id: str
    ) -> dict[int, wire.BucketPlan]:
        """Read every verdict; publish go (with each reshard plan, and the id that names this
        manifest in later rounds) or cancel everyone and raise."""
        offered = manifest.by_name()
        rejected: dict[int, str] = {}
        plans: dict[int, wire.BucketPlan] = {}
        for group_rank in range(1, self.rendezvous.group_size):
            global_rank = self.rendezvous.global_rank(group_rank)
            raw = comm.get(wire.verdict_key(group_rank), what=f"the verdict of rank {global_rank}")
            try:
                verdict = wire.Verdict.decode(raw)
                if verdict.ok and manifest.transport == "reshard":
                    plans[group_rank] = _reshard_plan(verdict.regions, offered, manifest)
            except ValueError as error:
                rejected[global_rank] = f"unusable verdict: {error}"
                continue
            if not verdict.ok:
                rejected[global_rank] = verdict.error
        if rejected:
            comm.set(wire.GO_KEY, wire.Go(False, f"{len(rejected)} receivers rejected the manifest").encode())
            raise errors.RefitRejected(rejected)
        for group_rank, plan in plans.items():
            comm.set(wire.plan_key(group_rank), plan.encode())
        comm.set(wire.GO_KEY, wire.Go(True, manifest=manifest_id).encode())
        return plans

    def _broadcast(
        self,
        comm: communicator.Communicator,
        plan: wire.BucketPlan,
        source: _Held | _Streamed,
        meanwhile: Callable[[], None],
        *,
        sealed: bool,
    ) -> int:
        """Broadcast the buckets of ``plan``, packing (and, ``sealed``, sealing) bucket k+1 into a
        second staging buffer while bucket k travels. Gloo: packing runs here while gloo's threads
        send. NCCL: packing runs on a side stream (after the caller's stream, which produced the
        tensors; tensors produced one at a time are waited for, and kept from reuse, each on its
        own), each broadcast waits for its bucket's packing, a buffer is packed again only once its
        broadcast ended (stream waits), and the host waits once, for the last broadcast;
        ``meanwhile`` runs just before that wait."""
        count = len(plan.sizes)
        slots = min(2, count)
        stream = cuda_streams.side_stream(self.device)
        buffers = [torch.empty(plan.largest, dtype=torch.uint8, device=self.device) for _ in range(slots)]
        current = torch.cuda.current_stream(self.device) if stream is not None else None
        if stream is not None and current is not None:
            stream.wait_stream(current)
            for buffer in buffers:
                buffer.record_stream(stream)
        by_bucket = _by_bucket(plan)
        in_flight: list[transfer_group.Pending | None] = [None] * slots
        issued: list[transfer_group.Pending] = []
        for bucket, size in enumerate(plan.sizes):
            slot = bucket % slots
            previous = in_flight[slot]
            if previous is not None:
                comm.finish(previous, stream=stream)  # the buffer's last broadcast has read it
            chunk = buffers[slot].narrow(0, 0, size)
            for placement in by_bucket[bucket]:
                tensor = source.take(placement.region.name)
                if stream is not None and current is not None and isinstance(source, _Streamed):
                    stream.wait_stream(current)  # the tensor may have just been produced there
                    tensor.record_stream(stream)  # its memory is not reused before the packing ran
                with cuda_streams.on_stream(stream):
                    wire.pack(chunk, placement, tensor)
            with cuda_streams.on_stream(stream):
                self._seal(chunk, bucket, sealed)
            if bucket == count - 1:
                source.finish()  # before the last bucket goes: a stream with more tensors fails here
            if current is not None and stream is not None:
                current.wait_stream(stream)  # NCCL's stream follows the current one: after the packing
            pending = comm.start_broadcast(chunk, what=f"bucket {bucket + 1} of {count}")
            in_flight[slot] = pending
            issued.append(pending)
        meanwhile()
        for pending in issued[-slots:]:
            comm.complete(pending)
        return count

    def _scatter(
        self,
        comm: communicator.Communicator,
        plans: dict[int, wire.BucketPlan],
        tensors: dict[str, torch.Tensor],
        meanwhile: Callable[[], None],
        *,
        sealed: bool,
    ) -> int:
        """Send each receiver its buckets, point to point; two staging buffers, so packing (and,
        ``sealed``, sealing) the next bucket overlaps sending the previous one; ``meanwhile`` runs
        before the wait for the last."""
        largest = max((plan.largest for plan in plans.values()), default=0)
        buffers = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(2)]
        in_flight: list[dist.Work | None] = [None, None]
        count = 0
        for group_rank, plan in sorted(plans.items()):
            by_bucket = _by_bucket(plan)
            for bucket, size in enumerate(plan.sizes):
                slot = count % 2
                what = f"bucket {bucket + 1} of {len(plan.sizes)} to rank {self.rendezvous.global_rank(group_rank)}"
                previous = in_flight[slot]
                if previous is not None:
                    comm.wait(previous, what=what)
                chunk = buffers[slot].narrow(0, 0, size)
                for placement in by_bucket[bucket]:
                    wire.pack(chunk, placement, tensors[placement.region.name])
                self._seal(chunk, bucket, sealed, receiver=group_rank)
                in_flight[slot] = comm.send(chunk, dst=group_rank, tag=bucket, what=what)
                count += 1
        meanwhile()
        for work in in_flight:
            if work is not None:
                comm.wait(work, what="the last buckets")
        return count

    def _seal(self, chunk: torch.Tensor, bucket: int, sealed: bool, *, receiver: int | None = None) -> None:
        """Seal packed bucket ``bucket`` with its trailer (``sealed``), on the current stream; under
        test, then flip its first byte (``corrupt_bucket``, to group rank ``receiver`` only when
        ``corrupt_receiver`` says so), so its digest no longer matches."""
        if sealed:
            trailers.seal(chunk, bucket)
        if bucket == self._corrupt_bucket and self._corrupt_receiver in (None, receiver):
            chunk.narrow(0, 0, 1).bitwise_xor_(0xFF)

    def _acknowledgements(self, comm: communicator.Communicator) -> None:
        failed: dict[int, str] = {}
        for group_rank in range(1, self.rendezvous.group_size):
            global_rank = self.rendezvous.global_rank(group_rank)
            raw = comm.get(wire.done_key(group_rank), what=f"the outcome of rank {global_rank}")
            try:
                done = wire.Done.decode(raw)
            except ValueError as error:
                failed[global_rank] = str(error)
                continue
            if not done.ok:
                failed[global_rank] = done.error
        if failed:
            raise errors.ReceiverFailed(failed)


@dataclasses.dataclass(frozen=True)
class _Offer:
    """A manifest every receiver accepted (and then received completely), with the plans it went by:
    sent again as it is (``key``: the tensors' names, shapes and dtypes, the bucket size, the
    transport), it is only confirmed by ``id`` in the next round's decision."""

    key: _OfferKey
    id: str
    manifest: wire.Manifest
    plans: dict[int, wire.BucketPlan]  # reshard: each receiver's (broadcast: the manifest's plan)


class _Held:
    """Every tensor at hand, by name (what :meth:`WeightSender.send` gets without ``shapes``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.infos = tuple(wire.TensorInfo.of(name, tensor) for name, tensor in tensors.items())

    def take(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def finish(self) -> None:
        pass


class _Streamed:
    """Tensors produced one at a time, in the order of ``infos`` (``send(..., shapes=...)``)."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]], infos: tuple[wire.TensorInfo, ...]) -> None:
        self._tensors = tensors
        self.infos = infos
        self._by_name = {info.name: info for info in infos}
        self._taken = 0

    def take(self, name: str) -> torch.Tensor:
        expected = self._by_name[name]
        try:
            given, tensor = next(self._tensors)
        except StopIteration:
            raise ValueError(f"the tensors ended after {self._taken}; {name} was next") from None
        self._taken += 1
        if given != name:
            raise ValueError(f"tensor {self._taken} is {given}, but the shapes put {name} there")
        info = wire.TensorInfo.of(given, tensor)
        if info != expected:
            raise ValueError(
                f"{name} is {list(info.shape)} {info.dtype}, but its shape says {list(expected.shape)} {expected.dtype}"
            )
        return tensor.detach()

    def finish(self) -> None:
        extra = next(self._tensors, None)
        if extra is not None:
            raise ValueError(f"the tensors go on past the {len(self.infos)} the shapes name, with {extra[0]}")


def _infos(shapes: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> tuple[wire.TensorInfo, ...]:
    infos = tuple(
        wire.TensorInfo(name, tuple(int(size) for size in shape), wire.dtype_name(dtype))
        for name, (shape, dtype) in shapes.items()
    )
    if not infos:
        raise ValueError("there are no tensors to send")
    return infos


def _collect(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in tensors:
            raise ValueError(f"{name} is given twice")
        tensors[name] = tensor.detach()
    if not tensors:
        raise ValueError("there are no tensors to send")
    return tensors


def _nbytes(info: wire.TensorInfo) -> int:
    return wire.Region.whole(info.name).nbytes(info)


def _reshard_plan(
    regions: tuple[wire.Region, ...], offered: dict[str, wire.TensorInfo], manifest: wire.Manifest
) -> wire.BucketPlan:
    """The buckets of one reshard receiver (sealed when the manifest names a digest); :class:`ValueError`
    for a region outside the manifest."""
    sized = []
    for region in regions:
        info = offered.get(region.name)
        if info is None:
            raise ValueError(f"it asks for {region.name}, which the manifest does not offer")
        region.check(info)
        sized.append((region, region.nbytes(info)))
    return wire.plan_buckets(sized, manifest.bucket_bytes, sealed=manifest.checksum is not None)


def _by_bucket(plan: wire.BucketPlan) -> list[list[wire.Placement]]:
    grouped: list[list[wire.Placement]] = [[] for _ in plan.sizes]
    for placement in plan.placements:
        grouped[placement.bucket].append(placement)
    return grouped
