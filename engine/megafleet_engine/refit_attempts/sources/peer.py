"""A live shard of the same fleet as a refit source: catch up to the fleet's current version from a peer.

Built by the agent's ``POST /v1/refit/peer`` (:class:`PeerRequest`) on a shard that joined or healed
behind the fleet's version, while the peer's agent sends (``POST /v1/peer/send``,
:mod:`megafleet_engine.peer_sends`). The copy runs over the megafleet wire itself: the peer's rank
``r`` is rank 0 of a small world at ``port + r`` (its :class:`~megafleet_protocol.refit.sender.WeightSender`
over its live tensors) and this shard's rank ``r`` joins it as rank ``index`` of ``1 + receivers``,
so the ranks pair one to one (a fleet's shards share one parallel layout). Everything else is the
rendezvous source's (:mod:`~megafleet_engine.refit_attempts.sources.rendezvous`): the handshake, the
manifest check (the version and every tensor's name, shape and dtype), the buckets' ``mf64`` digests
when the request asks for ``integrity: checksum``, the writes in place and the ``done`` that ends the
peer's send once this engine serves. The status names the source ``peer``; the world is not parked
(the peer closes it once the copy ended).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

from megafleet_engine.refit_attempts import phases
from megafleet_engine.refit_attempts.sources import rendezvous
from megafleet_protocol import agent_api, vocabulary

if TYPE_CHECKING:
    from megafleet_engine.refit_attempts import sources, weight_target

__all__ = ["PeerRequest", "PeerSource"]


@dataclasses.dataclass(frozen=True)
class PeerRequest:
    """Receive ``version`` from the peer at ``address`` (``POST /v1/refit/peer``): shard rank ``r``
    joins the world at ``port + r`` as its rank ``index`` of ``1 + receivers``."""

    version: int
    address: str
    port: int
    receivers: int = 1
    index: int = 1
    peer_shard: int | None = None  # the sending shard, for the log line
    bucket_size_mib: int = 1024
    timeout_seconds: float = 300.0
    suspend_mode: vocabulary.InFlightMode = "drain"
    kv_cache_mode: vocabulary.KvCacheMode | None = None
    staging: vocabulary.StagingMode = "off"
    local_address: str | None = None
    integrity: vocabulary.Integrity = "checksum"
    collective: vocabulary.CollectiveBackend | None = None
    commit: vocabulary.CommitMode = "local"  # a catch-up switches when its own copy is verified
    commit_grace_seconds: float = 30.0

    @classmethod
    def of(
        cls, body: agent_api.PeerRefitRequest, suspend_mode: vocabulary.InFlightMode, *, local_address: str | None
    ) -> PeerRequest:
        """The request of ``POST /v1/refit/peer``'s ``body`` (its in-flight mode as the agent checked it)."""
        peer = body.peer
        return cls(
            version=body.version,
            address=peer.address,
            port=peer.port,
            receivers=peer.receivers,
            index=peer.index,
            peer_shard=peer.shard,
            bucket_size_mib=body.bucket_size_mib,
            timeout_seconds=body.timeout_seconds,
            suspend_mode=suspend_mode,
            kv_cache_mode=body.kv_cache_mode,
            staging=body.staging,
            local_address=local_address,
            integrity=body.integrity,
            collective=body.collective,
        )

    @property
    def key(self) -> tuple[object, ...]:
        return ("peer", self.version, self.address, self.port, self.index)

    def world(self, rank: int) -> rendezvous.RendezvousRequest:
        """The rendezvous request of shard rank ``rank``: its own world with the peer's rank ``rank``."""
        return rendezvous.RendezvousRequest(
            version=self.version,
            address=self.address,
            port=self.port + rank,
            world_size=1 + self.receivers,
            rank_offset=self.index - rank,  # this rank is global rank ``index`` of its world
            bucket_size_mib=self.bucket_size_mib,
            timeout_seconds=self.timeout_seconds,
            suspend_mode=self.suspend_mode,
            kv_cache_mode=self.kv_cache_mode,
            staging=self.staging,
            local_address=self.local_address,
            integrity=self.integrity,
            collective=self.collective,
        )

    def source(self, target: weight_target.WeightTarget) -> PeerSource:
        """:class:`ValueError` for an index outside the receivers."""
        if not 1 <= self.index <= self.receivers:
            raise ValueError(f"peer.index {self.index} is not one of the {self.receivers} receivers")
        return PeerSource(self, target.rank)


class _Held:
    """Takes what the rendezvous source would park, so the world is closed once the peer heard ``done``."""

    def __init__(self) -> None:
        self.kept: rendezvous.Parked | None = None

    def park(self, kept: rendezvous.Parked) -> None:
        self.kept = kept


class PeerSource:
    """One attempt of a :class:`PeerRequest` as shard rank ``rank``: the rendezvous source over the
    peer's world, reported as ``peer`` and never parked."""

    def __init__(self, request: PeerRequest, rank: int) -> None:
        self.request = request
        self._inner = rendezvous.RendezvousSource(request.world(rank), rank)
        self._held = _Held()

    def record(self) -> phases.Progress:
        inner = self._inner
        return phases.Progress(
            version=self.request.version,
            source="peer",
            transport="broadcast",
            rank=inner.global_rank,
            world_size=inner.request.world_size,
        )

    def describe(self) -> str:
        request, inner = self.request, self._inner.request
        shard = f"shard {request.peer_shard} at " if request.peer_shard is not None else ""
        return (
            f"catch-up from {shard}{inner.address}:{inner.port} as rank {request.index} of "
            f"{inner.world_size}, timeout {request.timeout_seconds:g} s"
        )

    def run(self, run: sources.Run) -> None:
        self._inner.run(run)

    def keep(self, target: weight_target.WeightTarget) -> None:
        self._inner.keep(cast("weight_target.WeightTarget", self._held))

    def report(self, error: str | None) -> None:
        self._inner.report(error)
        kept, self._held.kept = self._held.kept, None
        if kept is not None:  # the peer has its ``done``: nothing reuses this world
            kept.comm.close()

    def abort(self, reason: str) -> None:
        self._inner.abort(reason)

    def close(self) -> None:
        self._inner.close()
        kept, self._held.kept = self._held.kept, None
        if kept is not None:
            kept.comm.close()

    def runs_over(self, session: str) -> bool:
        return False
