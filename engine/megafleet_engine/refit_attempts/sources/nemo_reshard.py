"""NeMo RL's M-to-N reshard as a refit source: one refit from an unmodified NeMo trainer's
``nccl_reshard_refit`` (:mod:`megafleet_protocol.refit.nemo_reshard`) written into the engine's sink.

Built by the agent's ``POST /v1/refit/nemo/reshard`` (:class:`ReshardRequest`) for a session whose NeMo
world this rank joined (``/v1/refit/nemo/join``) and whose stage communicators it joined beside it
(``/v1/refit/nemo/reshard/join``); run by the refit attempt on its thread. As NeMo's generation worker
receives: the bulk first (each FFN projection's box of this rank, from the stages' trainer ranks, then
its replica group's fan-out), stage after stage over the stage communicators, then the other ("misc")
tensors over NeMo's world in NeMo's packed buckets (:mod:`~.nemo_collective`'s receiver), strictly after
the bulk. Every received box is written through the attempt's ``apply`` (the backend thread, or the
staging copy); the version is complete only when the sink holds every parameter.

Before anything is suspended, :meth:`ReshardRequest.source` checks the refit info against what this
rank holds (:class:`~megafleet_engine.refit_attempts.sources.Unfit` otherwise): every parameter is bulk
or misc with its shape, and the box NeMo's plan gives this rank of each bulk parameter covers every
slice this rank keeps of it (a trainer that planned for another inference layout is refused, never
received into the wrong slices). A session refit never joins: without the parked NeMo world or the
joined stages it fails; a failed one breaks both (NeMo's trainer ranks are in the same exchange).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from megafleet_engine.refit_attempts import phases, sources
from megafleet_engine.refit_attempts.sources import nemo_collective
from megafleet_protocol import agent_api, vocabulary
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    import torch

    from megafleet_engine.refit_attempts import weight_target
    from megafleet_protocol.refit import nemo, nemo_reshard, nemo_reshard_info, receiver, wire

__all__ = ["ReshardRequest", "ReshardSource", "Stages", "check_layout"]


class Stages(Protocol):
    """The stage communicators joined for the session (the controller's membership of them)."""

    @property
    def rank(self) -> int:
        """This rank in every stage communicator."""
        ...

    def receiver(self) -> nemo_reshard.ReshardReceiver:
        """The joined receiver; :class:`RefitError` unless joined."""
        ...

    def fail(self, reason: str) -> None:
        """A refit over them failed: they cannot be reused."""


@dataclasses.dataclass(frozen=True)
class ReshardRequest:
    """Receive ``misc.version`` by NeMo's M-to-N reshard: ``info`` (NeMo's refit info, parsed) says
    what the bulk is and where it comes from, ``stages`` carries it, and ``misc`` is the session's
    refit over NeMo's world for the rest (its refit info: the misc tensors, its modes: this refit's)."""

    misc: nemo_collective.NemoRequest
    info: nemo_reshard_info.ReshardInfo
    stages: Stages

    @classmethod
    def of(
        cls,
        body: agent_api.NemoReshardRefitRequest,
        joined: nemo_collective.NemoJoinRequest,
        stages: Stages,
        suspend_mode: vocabulary.InFlightMode,
        commit: vocabulary.CommitMode,
        commit_grace_seconds: float,
    ) -> ReshardRequest:
        """The agent's body as a refit over the session's NeMo world ``joined`` and its ``stages``
        (:class:`ValueError` for a refit info that does not parse)."""
        from megafleet_protocol.refit import nemo_reshard_info

        info = nemo_reshard_info.ReshardInfo.parse(body.refit_info)
        misc = joined.refit(
            version=body.version,
            refit_info=tuple((name, shape, str(dtype).removeprefix("torch.")) for name, shape, dtype in info.misc),
            bucket_bytes=body.bucket_bytes,
            timeout_seconds=body.timeout_seconds,
            suspend_mode=suspend_mode,
            kv_cache_mode=body.kv_cache_mode,
            staging=body.staging,
        )
        misc = dataclasses.replace(misc, commit=commit, commit_grace_seconds=commit_grace_seconds)
        return cls(misc, info, stages)  # the joined world's generation: the parked membership's key

    @property
    def version(self) -> int:
        return self.misc.version

    @property
    def timeout_seconds(self) -> float:
        return self.misc.timeout_seconds

    @property
    def suspend_mode(self) -> vocabulary.InFlightMode:
        return self.misc.suspend_mode

    @property
    def staging(self) -> vocabulary.StagingMode:
        return self.misc.staging

    @property
    def kv_cache_mode(self) -> vocabulary.KvCacheMode | None:
        return self.misc.kv_cache_mode

    @property
    def commit(self) -> vocabulary.CommitMode:
        return self.misc.commit

    @property
    def commit_grace_seconds(self) -> float:
        return self.misc.commit_grace_seconds

    @property
    def key(self) -> tuple[object, ...]:
        return ("nemo_reshard", *self.misc.key)

    def source(self, target: weight_target.WeightTarget) -> ReshardSource:
        """Refuse a reshard this rank cannot take, before anything is suspended: a rank outside NeMo's
        inference ranks (:class:`ValueError`), or a refit info that does not fit what it holds
        (:class:`~megafleet_engine.refit_attempts.sources.Unfit`, :func:`check_layout`)."""
        self.misc.world(target.rank)
        sink = target.fresh_sink()
        try:
            receives = check_layout(self.info, self.stages.rank, sink.regions(), sink.required())
        except ValueError as error:
            raise sources.Unfit(f"NeMo's reshard refit info does not fit this engine: {error}") from None
        return ReshardSource(self, target.rank, receives)


def check_layout(
    info: nemo_reshard_info.ReshardInfo,
    rank: int,
    held: Sequence[wire.Region],
    required: dict[str, tuple[int, ...]],
) -> list[nemo_reshard_info.Receive]:
    """Stage-communicator rank ``rank``'s receive map of ``info``, checked against what it holds
    (``held``: its regions, ``required``: full shapes): every held tensor is bulk or misc in its
    shape, and each bulk box covers every region held of that tensor. :class:`ValueError` names the
    first misfit."""
    from megafleet_protocol.refit import nemo

    bulk = {param.name for param in info.params}
    specs = [nemo.TensorSpec(name, shape, dtype) for name, shape, dtype in info.misc]
    try:
        nemo.check_refit_info(specs, {name: shape for name, shape in required.items() if name not in bulk})
    except errors.ManifestMismatch as error:
        raise ValueError(f"its misc tensors: {error}") from None
    receives = info.receive_map(rank, {name: shape for name, shape in required.items() if name in bulk})
    boxes = {entry.param.name: entry.region for entry in receives}
    for region in held:
        box = boxes.get(region.name)
        if box is None:
            continue
        fits = box.is_whole if region.is_whole else box.covers(region.dim or 0, region.start, region.stop)
        if not fits:
            raise ValueError(
                f"NeMo's plan gives rank {rank} {_slice(box)} of {region.name}, but this rank keeps {_slice(region)}: "
                "the trainer planned for another inference layout (generation tensor parallelism)"
            )
    return receives


def _slice(region: wire.Region) -> str:
    return "all" if region.is_whole else f"[{region.start}, {region.stop}) of dimension {region.dim}"


class ReshardSource:
    """One attempt of a :class:`ReshardRequest` as shard-local rank ``rank``."""

    def __init__(self, request: ReshardRequest, rank: int, receives: list[nemo_reshard_info.Receive]) -> None:
        self.request = request
        self.rank = rank
        self.receives = receives
        self._lock = threading.Lock()  # guards what the attempt's thread took (an abort reads it)
        self._joined: nemo.NemoReceiver | None = None  # NeMo's world (the misc tensors), parked again on success
        self._bulk: nemo_reshard.ReshardReceiver | None = None  # the stages, kept by their membership
        self._key: tuple[object, ...] | None = None

    def record(self) -> phases.Progress:
        misc = self.request.misc
        return phases.Progress(
            version=misc.version,
            source="nemo",
            transport="reshard",
            rank=misc.rank_offset + self.rank,
            world_size=misc.world_size,
        )

    def describe(self) -> str:
        misc, info = self.request.misc, self.request.info
        return (
            f"NeMo's M-to-N reshard over {info.pp_size} stage communicators as rank {self.request.stages.rank}, "
            f"{len(self.receives)} bulk tensors, then {len(info.misc)} over NeMo's world at {misc.address}:{misc.port} "
            f"as rank {misc.rank_offset + self.rank} in buckets of {misc.bucket_bytes} bytes, "
            f"timeout {misc.timeout_seconds:g} s"
        )

    def run(self, run: sources.Run) -> None:
        """Take NeMo's world (parked by the session's join or last refit) and the joined stages, then,
        once the suspend ended, receive the bulk over the stages and the misc tensors over the world."""
        from megafleet_protocol.refit import communicator, nemo

        request, record = self.request, run.record
        misc = request.misc
        suspended = run.start_suspend()
        record.enter("joining")
        sink = run.target.fresh_sink()
        before = run.target.live_pointers()
        world = misc.world(self.rank)
        local_address = misc.local_address or communicator.local_address_towards(misc.address)
        key = nemo_collective.world_key(world, local_address, misc.generation)
        parked = run.take_parked(key, nemo_collective.Joined)
        if parked is None:
            raise errors.RefitError(
                f"this rank no longer holds NeMo's world for session {misc.session!r}; a session refit never joins"
            )
        record.set_reused(True)
        with self._lock:
            self._joined, self._key = parked.receiver, key
        bulk = request.stages.receiver()
        with self._lock:
            self._bulk = bulk
        if record.finished:  # aborted meanwhile: the abort did not see them
            self.abort("aborted while taking the communicators")
            raise errors.RefitAborted("the refit was aborted while joining")
        run.wait_suspended(suspended)
        record.enter("receiving")
        with record.timed("receive"):
            stats = bulk.receive(self.receives, write=_writer(sink, run.apply), deadline=run.deadline)
            specs = [nemo.TensorSpec(name, shape, dtype) for name, shape, dtype in request.info.misc]
            rest = parked.receiver.receive(
                specs,
                bucket_bytes=misc.bucket_bytes,
                device=sink.device,
                write=nemo_collective.writer(sink, run.apply),
                deadline=run.deadline,
            )
        missing = sink.missing()
        if missing:
            raise errors.RefitError(f"NeMo's reshard left {len(missing)} parameters unwritten, e.g. {missing[:3]}")
        record.count(
            bytes_received=stats.bytes_received + rest.bytes_received,
            buckets=rest.buckets,
            tensors_written=stats.regions_written + rest.tensors_written,
        )
        run.target.verify_in_place(before)

    def keep(self, target: weight_target.WeightTarget) -> None:
        """Park NeMo's world again for the session's next refit; the stages stay with their membership."""
        with self._lock:
            joined, self._joined = self._joined, None
            self._bulk = None
        if joined is not None and self._key is not None:
            target.park(nemo_collective.Joined(self._key, joined))

    def report(self, error: str | None) -> None:
        """Nothing to tell: NeMo's wire has no outcome message (the status says it)."""

    def abort(self, reason: str) -> None:
        with self._lock:
            joined, bulk = self._joined, self._bulk
        if joined is not None:
            joined.abort()
        if bulk is not None:
            self.request.stages.fail(reason)

    def close(self) -> None:
        with self._lock:
            joined, self._joined = self._joined, None
            bulk, self._bulk = self._bulk, None
        if joined is not None:  # not kept: this attempt failed
            joined.close()
        if bulk is not None:
            self.request.stages.fail("the refit did not complete")

    def runs_over(self, session: str) -> bool:
        return self.request.misc.session == session


def _writer(sink: receiver.Sink, apply: receiver.Apply) -> nemo_reshard.Write:
    """The bulk's ``write(region, tensor)`` over ``sink``, through ``apply`` (the backend thread)."""

    def write(region: wire.Region, tensor: torch.Tensor) -> int:
        return apply(lambda: sink.write(region, tensor))

    return write
