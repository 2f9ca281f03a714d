"""NeMo RL's collective as a refit source: one refit from an unmodified NeMo trainer's packed broadcast
(:mod:`megafleet_protocol.refit.nemo`) written into the engine's sink, in place.

Built by the agent's ``POST /v1/refit/nemo`` (:class:`NemoRequest`, or :meth:`NemoJoinRequest.refit`
for a session's refit) and run by the refit attempt (:mod:`megafleet_engine.refit_attempts.attempt`)
on its thread: the suspend starts first; the attempt keeps the membership of NeMo's world parked by
the last NeMo refit (or by the session's join, :mod:`megafleet_engine.refit_attempts.nemo_world`) over
the same world, or joins it once the suspend ended (:meth:`NemoReceiver.connect`; a session's refit
never joins, since NeMo cannot rebuild its collective), then calls :func:`receive` with the sink and
the attempt's ``apply`` (the backend thread). After the engine serves the version the membership is
parked again for the next refit (docs/refit-protocol.md, "NeMo RL's collective").
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megafleet_engine.refit_attempts import phases, sources
from megafleet_protocol import vocabulary
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    import torch

    from megafleet_engine.refit_attempts import weight_target
    from megafleet_protocol.refit import communicator, nemo, receiver

__all__ = ["Joined", "NemoJoinRequest", "NemoRequest", "NemoSource", "receive", "world_key", "writer"]

RefitInfo = tuple[tuple[str, tuple[int, ...], str], ...]
"""NeMo's refit info: ``(name, shape, dtype name)`` of each tensor, in the wire's order."""


@dataclasses.dataclass(frozen=True)
class NemoRequest:
    """Receive ``version`` from an unmodified NeMo RL trainer's own collective (``POST /v1/refit/nemo``):
    this rank is ``rank_offset`` + its shard-local rank in NeMo's world of ``world_size`` ranks, the
    refit is NeMo's packed broadcast of ``refit_info`` (``(name, shape, dtype name)`` in the wire's
    order) in buckets of the trainer's target ``bucket_bytes``."""

    version: int
    address: str
    port: int
    world_size: int
    rank_offset: int
    trainer_world_size: int
    refit_info: RefitInfo
    bucket_bytes: int
    generation: vocabulary.NemoGeneration | None = None  # None: as the trainer's store tells
    timeout_seconds: float = 300.0
    suspend_mode: vocabulary.InFlightMode = "drain"
    kv_cache_mode: vocabulary.KvCacheMode | None = None
    local_address: str | None = None  # where this rank's gloo transport binds; None: the route to the trainer
    session: str | None = None  # set: receive over the world joined for this session, never join
    integrity: vocabulary.Integrity = "none"  # checksum: digest every bucket, count non-finite values
    staging: vocabulary.StagingMode = "off"
    commit: vocabulary.CommitMode = "local"  # staged: wait for the trainer's or the operator's commit
    commit_grace_seconds: float = 30.0  # how long past the deadline a staged attempt waits for it

    @property
    def key(self) -> tuple[object, ...]:
        return ("nemo", self.version, self.address, self.port, self.world_size, self.rank_offset)

    def world(self, rank: int) -> nemo.NemoWorld:
        """NeMo's world as shard-local rank ``rank`` joins it (:class:`ValueError`: not an inference rank)."""
        from megafleet_protocol.refit import nemo

        global_rank = self.rank_offset + rank
        return nemo.NemoWorld(self.address, self.port, self.world_size, global_rank, self.trainer_world_size)

    def specs(self) -> list[nemo.TensorSpec]:
        """The refit info as NeMo's specs (:class:`ValueError` for an unknown dtype)."""
        from megafleet_protocol.refit import nemo

        return nemo.refit_info({name: (shape, dtype) for name, shape, dtype in self.refit_info})

    def source(self, target: weight_target.WeightTarget) -> NemoSource:
        """Refuse (:class:`ValueError`) a NeMo refit this rank cannot take, before it suspends anything:
        a rank outside NeMo's inference ranks, an unknown dtype, or a refit info that lacks a parameter
        this rank holds or gives one another shape (:class:`~megafleet_engine.refit_attempts.sources.Unfit`:
        the trainer cannot hear the refusal, its broadcasts time out, so the world joined for earlier
        refits is left too)."""
        from megafleet_protocol.refit import nemo

        self.world(target.rank)
        try:
            nemo.check_refit_info(self.specs(), target.fresh_sink().required())
        except errors.ManifestMismatch as error:
            raise sources.Unfit(f"NeMo's refit info does not fit this engine: {error}") from None
        return NemoSource(self, target.rank)


@dataclasses.dataclass(frozen=True)
class NemoJoinRequest:
    """Join NeMo's world at the trainer's ``init_collective`` time (``POST /v1/refit/nemo/join``): no
    version, no refit info, nothing suspended. The membership is kept for the refits of ``session``
    (:meth:`refit` builds them), exactly as a successful :class:`NemoRequest` keeps its own."""

    session: str
    address: str
    port: int
    world_size: int
    rank_offset: int
    trainer_world_size: int
    generation: vocabulary.NemoGeneration | None = None
    timeout_seconds: float = 240.0
    local_address: str | None = None

    def world(self, rank: int) -> nemo.NemoWorld:
        """NeMo's world as shard-local rank ``rank`` joins it (:class:`ValueError`: not an inference rank)."""
        from megafleet_protocol.refit import nemo

        return nemo.NemoWorld(
            self.address, self.port, self.world_size, self.rank_offset + rank, self.trainer_world_size
        )

    def refit(
        self,
        *,
        version: int,
        refit_info: RefitInfo,
        bucket_bytes: int,
        timeout_seconds: float,
        suspend_mode: vocabulary.InFlightMode,
        kv_cache_mode: vocabulary.KvCacheMode | None,
        staging: vocabulary.StagingMode = "off",
    ) -> NemoRequest:
        """A refit over this joined world: the same world, generation and bind address, so it reuses
        the membership (and fails rather than join when the membership is gone)."""
        return NemoRequest(
            version=version,
            address=self.address,
            port=self.port,
            world_size=self.world_size,
            rank_offset=self.rank_offset,
            trainer_world_size=self.trainer_world_size,
            refit_info=refit_info,
            bucket_bytes=bucket_bytes,
            generation=self.generation,
            timeout_seconds=timeout_seconds,
            suspend_mode=suspend_mode,
            kv_cache_mode=kv_cache_mode,
            local_address=self.local_address,
            session=self.session,
            staging=staging,
        )


def world_key(
    world: nemo.NemoWorld, local_address: str, generation: vocabulary.NemoGeneration | None
) -> tuple[object, ...]:
    """The key a membership of NeMo's world is parked under: a refit reuses it when it computes the same."""
    return ("nemo", world, local_address, generation)


@dataclasses.dataclass(frozen=True)
class Joined:
    """Membership of NeMo's world kept after a successful NeMo refit or a session's join (NeMo builds
    its world once per run and refits over it step after step; it cannot be rebuilt), and the world
    and bind address it serves (:func:`world_key`)."""

    key: tuple[object, ...]
    receiver: nemo.NemoReceiver

    def discard(self) -> None:
        self.receiver.close()


class NemoSource:
    """One attempt of a :class:`NemoRequest` as shard-local rank ``rank``."""

    def __init__(self, request: NemoRequest, rank: int) -> None:
        self.request = request
        self.rank = rank
        self._lock = threading.Lock()  # guards _joined (the attempt's thread sets it, an abort reads it)
        self._joined: nemo.NemoReceiver | None = None  # this attempt's membership of NeMo's world
        self._key: tuple[object, ...] | None = None

    def record(self) -> phases.Progress:
        request = self.request
        return phases.Progress(
            version=request.version,
            source="nemo",
            transport="broadcast",
            rank=request.rank_offset + self.rank,
            world_size=request.world_size,
        )

    def describe(self) -> str:
        request = self.request
        return (
            f"NeMo's collective at {request.address}:{request.port} as rank "
            f"{request.rank_offset + self.rank} of {request.world_size}, {len(request.refit_info)} tensors "
            f"in buckets of {request.bucket_bytes} bytes, timeout {request.timeout_seconds:g} s"
        )

    def run(self, run: sources.Run) -> None:
        """Join NeMo's world (or keep the membership of the last NeMo refit over the same world), then
        receive its packed broadcast into the engine's sink, in place, once the suspend ended."""
        from megafleet_protocol.refit import communicator, nemo

        request, record = self.request, run.record
        suspended = run.start_suspend()
        record.enter("joining")
        sink = run.target.fresh_sink()
        before = run.target.live_pointers()
        world = request.world(self.rank)
        local_address = request.local_address or communicator.local_address_towards(request.address)
        key = world_key(world, local_address, request.generation)
        parked = run.take_parked(key, Joined)
        joined = parked.receiver if parked is not None else None
        record.set_reused(joined is not None)
        if joined is None and request.session is not None:
            raise errors.RefitError(
                f"this rank no longer holds NeMo's world for session {request.session!r}; a session refit never "
                "joins (NeMo cannot rebuild its collective)"
            )
        if joined is None:
            with record.timed("join"):
                run.wait_suspended(suspended)  # NCCL's buffers come after whatever the suspend frees
                joined = nemo.NemoReceiver.connect(
                    world,
                    backend="nccl" if sink.device.type == "cuda" else "gloo",
                    device=sink.device,
                    deadline=run.deadline,
                    aborted=run.aborted,
                    generation=request.generation,
                    local_address=local_address,
                )
        with self._lock:
            self._joined, self._key = joined, key
        if record.finished:  # aborted while joining: the abort did not see this membership
            joined.abort()
            raise errors.RefitAborted("the refit was aborted while joining")
        run.wait_suspended(suspended)
        record.enter("receiving")
        with record.timed("receive"):
            try:
                stats = receive(
                    joined, sink, specs=request.specs(), bucket_bytes=request.bucket_bytes, apply=run.apply,
                    deadline=run.deadline, integrity=request.integrity,
                )  # fmt: skip
            except errors.NonFiniteWeights as error:
                if error.outcome is not None:
                    record.verified(error.outcome)
                raise
        if stats.verification is not None:
            record.verified(stats.verification)
        record.count(bytes_received=stats.bytes_received, buckets=stats.buckets, tensors_written=stats.tensors_written)
        run.target.verify_in_place(before)

    def keep(self, target: weight_target.WeightTarget) -> None:
        """Keep this attempt's membership of NeMo's world for the next NeMo refit over it."""
        with self._lock:
            joined, self._joined = self._joined, None
        if joined is not None and self._key is not None:
            target.park(Joined(self._key, joined))

    def report(self, error: str | None) -> None:
        """Nothing to tell: NeMo's wire has no outcome message (the status says it)."""

    def abort(self, reason: str) -> None:
        with self._lock:
            joined = self._joined
        if joined is not None:
            joined.abort()

    def close(self) -> None:
        with self._lock:
            joined, self._joined = self._joined, None
        if joined is not None:  # not kept: this attempt failed
            joined.close()

    def runs_over(self, session: str) -> bool:
        return self.request.session == session


def writer(sink: receiver.Sink, apply: receiver.Apply) -> nemo.Write:
    """NeMo's ``post_unpack_func`` over ``sink``: each bucket's whole tensors written through
    ``apply`` (which returns once the copies were issued, before the next bucket reuses the buffer)."""
    from megafleet_protocol.refit import wire

    def write(tensors: list[tuple[str, torch.Tensor]]) -> int:
        def copy() -> int:
            return sum(sink.write(wire.Region.whole(name), tensor) for name, tensor in tensors)

        return apply(copy)

    return write


def receive(
    joined: nemo.NemoReceiver,
    sink: receiver.Sink,
    *,
    specs: Sequence[nemo.TensorSpec],
    bucket_bytes: int,
    apply: receiver.Apply,
    deadline: communicator.Deadline,
    integrity: vocabulary.Integrity = "none",
) -> nemo.Stats:
    """Receive one refit over ``joined`` into ``sink``: the refit info is checked against what the
    sink holds first (:class:`ManifestMismatch` before any byte), and the version must be complete
    afterwards (:class:`RefitError` naming what was left unwritten); ``integrity`` as
    :meth:`NemoReceiver.receive <megafleet_protocol.refit.nemo.NemoReceiver.receive>` takes it."""
    stats = joined.receive(
        specs,
        bucket_bytes=bucket_bytes,
        device=sink.device,
        write=writer(sink, apply),
        deadline=deadline,
        required=sink.required(),
        integrity=integrity,
    )
    missing = sink.missing()
    if missing:
        raise errors.RefitError(f"NeMo's refit left {len(missing)} parameters unwritten, e.g. {missing[:3]}")
    return stats
