"""The sending end of a catch-up from a peer: a Ready engine sends its live weights to shards behind.

Called by the agent's ``POST /v1/peer/send`` (:mod:`megafleet_engine.agent_server`) in each engine
rank's process, one :class:`PeerSends` per process; the operator asks for it
(:mod:`megafleet.reconcile.peer_catch_up`) only while no refit runs and no RefitSession holds the fleet,
and asks the catching-up shards to receive (``POST /v1/refit/peer``,
:mod:`megafleet_engine.refit_attempts.sources.peer`).

The copy is the megafleet wire's own trainer side: a
:class:`~megafleet_protocol.refit.sender.WeightSender` as rank 0 of a world of ``1 + receivers`` ranks
at ``port + rank`` on this pod's address, over gloo (CPU) or NCCL (GPU) as the request's
``collective`` says, broadcasting whole tensors by Hugging Face name and sealing every bucket with
its ``mf64`` digest when the receivers ask (``integrity: checksum``). It runs on a thread of its own
and only reads: the engine serves on (no suspend, no pause), its backend thread generating from the
same tensors meanwhile. The version is checked before the first tensor is read and after the last
(the engine still serves ``version``, no refit was admitted meanwhile and none left it dirty), so a
refit that slipped in fails the copy instead of sending a mixture; the receivers then fail too and
stay Stale.

A backend that holds its weights in a sharded layout (``shard_map()`` is not ``None``: megatron with
tensor or pipeline parallelism) sends nothing: its tensors are slices under megatron names that no
receiver's sink takes as whole tensors, so the operator catches such a shard up from the checkpoint
(:class:`Unsupported`, 409 ``peer_layout_unsupported``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from megafleet_engine import siblings as siblings_module
from megafleet_engine.openai import errors
from megafleet_protocol import agent_api, vocabulary

if TYPE_CHECKING:
    import torch

    from megafleet_engine import engine as engine_module
    from megafleet_engine.refit_attempts import controller as refit_controller
    from megafleet_protocol.refit import sender as refit_sender

__all__ = ["NotCurrent", "PeerSendRequest", "PeerSends", "SendSnapshot", "Unsupported", "forward", "status_body"]

log = logging.getLogger(__name__)


class Unsupported(errors.Conflict):
    """This engine's backend cannot send a peer copy (its weights are sharded): 409 ``peer_layout_unsupported``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="peer_layout_unsupported")


class NotCurrent(errors.Conflict):
    """This engine does not serve the requested version now (or a refit runs or left it dirty), or
    another copy is being sent from it: 409 ``peer_not_current``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="peer_not_current")


Phase = Literal["idle", "sending", "sent", "failed"]


@dataclasses.dataclass(frozen=True)
class PeerSendRequest:
    """Send ``version`` to ``receivers`` catching-up shards from the world at ``port + rank``."""

    version: int
    port: int
    receivers: int = 1
    timeout_seconds: float = 300.0
    bucket_size_mib: int = 1024
    integrity: vocabulary.Integrity = "checksum"
    collective: vocabulary.CollectiveBackend | None = None
    address: str | None = None  # where the store and the transport listen; None: this host's address

    @classmethod
    def of(cls, body: agent_api.PeerSendRequest, address: str | None) -> PeerSendRequest:
        """The request of ``POST /v1/peer/send``'s ``body``, listening on ``address``."""
        return cls(**body.model_dump(), address=address)


@dataclasses.dataclass(frozen=True)
class SendSnapshot:
    """This rank's last copy as ``GET /v1/peer/status`` reports it."""

    phase: Phase = "idle"
    version: int | None = None
    port: int | None = None
    receivers: int = 0
    bytes_sent: int = 0
    buckets: int = 0
    verified: bool = False
    seconds: float | None = None
    error: str | None = None


def status_body(snapshots: list[SendSnapshot | dict[str, object]]) -> dict[str, object]:
    """The pod's answer from its ranks' snapshots (this rank's first, then the others' answers): the
    first failed one, else this rank's."""
    bodies = [
        agent_api.PeerSendStatus.model_validate(
            dataclasses.asdict(item) if isinstance(item, SendSnapshot) else item
        ).model_dump(mode="json", by_alias=True)
        for item in snapshots
    ]
    return next((body for body in bodies if body["phase"] == "failed"), bodies[0])


async def forward(
    peers: PeerSends, siblings: siblings_module.Siblings | None, body: agent_api.PeerSendRequest
) -> list[dict[str, object]]:
    """Send the call this rank accepted to the pod's other ranks (each sends from its own world);
    when one of them refuses, this rank's copy is aborted too and the call fails (409)."""
    if siblings is None:
        return []
    try:
        return await siblings.post(agent_api.PEER_SEND, body.model_dump(mode="json", by_alias=True))
    except siblings_module.SiblingError as error:
        peers.abort()
        raise NotCurrent(f"another rank of this pod sends no copy: {error}") from None


class PeerSends:
    """The peer copies one engine rank sends, one at a time.

    Args:
        engine: the engine whose live weights are read.
        refits: this rank's refit controller (a copy never overlaps a refit of this engine).
        rank: this process's rank inside its shard: its world listens at ``port + rank``.
    """

    def __init__(self, engine: engine_module.Engine, refits: refit_controller.RefitController, rank: int) -> None:
        self.engine = engine
        self.refits = refits
        self.rank = rank
        self._lock = threading.Lock()
        self._state = SendSnapshot()
        self._request: PeerSendRequest | None = None
        self._thread: threading.Thread | None = None
        self._sender: refit_sender.WeightSender | None = None  # the running one, for abort

    def snapshot(self) -> SendSnapshot:
        with self._lock:
            return self._state

    def start(self, request: PeerSendRequest) -> SendSnapshot:
        """Start sending ``request`` on a thread; returns at once. The same request again while it
        runs answers its status. Raises :class:`Unsupported` on a sharded backend, :class:`NotCurrent`
        when the engine does not serve ``request.version`` (or a refit runs or left it dirty) and
        :class:`NotCurrent` too while another copy runs."""
        if self.engine.backend.shard_map() is not None:
            raise Unsupported(
                f"the {type(self.engine.backend).__name__} backend holds sharded weights, which no peer copy "
                "sends: a shard catches up from the checkpoint"
            )
        self._check_current(request.version)
        with self._lock:
            if self._state.phase == "sending":
                if self._request == request:
                    return self._state
                raise NotCurrent(f"a copy of weight version {self._state.version} is being sent from this engine")
            self._request = request
            self._state = SendSnapshot("sending", request.version, request.port + self.rank, request.receivers)
            thread = threading.Thread(target=self._run, args=(request,), name="megafleet-peer-send", daemon=True)
            self._thread = thread
        thread.start()
        return self.snapshot()

    def abort(self) -> None:
        """End a copy in progress (engine shutdown); its receivers fail and stay Stale."""
        with self._lock:
            sender = self._sender
        if sender is not None:
            sender.abort()

    def join(self, timeout: float) -> bool:
        """Wait until the last copy's thread ended (tests, shutdown); returns whether it did."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _check_current(self, version: int) -> None:
        engine, refits = self.engine, self.refits
        if refits.running or refits.dirty:
            raise NotCurrent("a refit runs on this engine (or left its weights incomplete): it sends no copy")
        if engine.state != "ready" or engine.weight_version != version:
            raise NotCurrent(
                f"this engine is {engine.state} at weight version {engine.weight_version}, not serving {version}"
            )

    def _run(self, request: PeerSendRequest) -> None:
        from megafleet_protocol.refit import sender as refit_sender

        started = time.monotonic()
        try:
            live = self.engine.backend.parameters()  # references only: the engine serves on from them
            device = next(iter(live.values())).device
            backend = request.collective or ("nccl" if device.type == "cuda" else "gloo")
            sender = refit_sender.WeightSender(
                request.port + self.rank,
                1 + request.receivers,
                backend=backend,
                address=request.address,
                timeout_seconds=request.timeout_seconds,
                device=device if backend == "nccl" else "cpu",
                integrity=request.integrity,
            )
            with self._lock:
                self._sender = sender
            with sender:
                sender.init()
                shapes = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in live.items()}
                report = sender.send(
                    self._read(live, request.version),
                    request.bucket_size_mib,
                    version=request.version,
                    shapes=shapes,
                )
        except Exception as error:  # the copy failed: the receivers fail with it and stay Stale
            log.warning("peer copy of weight version %d failed: %s", request.version, error)
            self._finish(request, started, error=f"{type(error).__name__}: {error}")
            return
        log.info(
            "sent weight version %d to %d catching-up shards (%d buckets, %d bytes, verified %s) in %.2f s",
            request.version,
            report.receivers,
            report.buckets,
            report.bytes_sent,
            report.verified,
            report.seconds,
        )
        self._finish(request, started, buckets=report.buckets, nbytes=report.bytes_sent, verified=report.verified)

    def _read(self, live: dict[str, torch.Tensor], version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The live tensors, one at a time, as the sender packs them; the version is checked before
        the first and after the last (the sender asks past the last before the last bucket goes)."""
        for name, tensor in live.items():
            self._check_current(version)
            yield name, tensor
        self._check_current(version)

    def _finish(
        self,
        request: PeerSendRequest,
        started: float,
        *,
        error: str | None = None,
        buckets: int = 0,
        nbytes: int = 0,
        verified: bool = False,
    ) -> None:
        with self._lock:
            self._sender = None
            self._state = SendSnapshot(
                "failed" if error else "sent",
                request.version,
                request.port + self.rank,
                request.receivers,
                bytes_sent=nbytes,
                buckets=buckets,
                verified=verified,
                seconds=time.monotonic() - started,
                error=error,
            )
