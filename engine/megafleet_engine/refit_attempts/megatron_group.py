"""megatron-core's refit group as this engine joins, keeps and leaves it, for megatron-native refits:
megatron-core's own receiver (``prepare_swap_model_weights`` and ``swap_model_weights``) joined to a
megatron-core trainer's refit group, as NeMo RL's Megatron synchronizer
(``init_collective_mcore_generation``, ``swap_weights_via_reshard``) runs it.

Called by the agent's routes ``POST /v1/refit/megatron/join``, ``POST /v1/refit/megatron`` and
``POST /v1/refit/megatron/leave`` (:mod:`megafleet_engine.agent_server`): one :class:`NativeRefits`
per engine process, next to its :class:`~megafleet_engine.refit_attempts.controller.RefitController`;
its join and its store probe run on a thread of their own.

* **Join** (no version, nothing suspended; returns at once): on a thread of its own, connect to the
  trainer's store at ``port + 1`` and build its refit group (the backend's
  :meth:`~megafleet_engine.backends.megatron.native_refit.NativeRefit.connect`), then run
  ``prepare_swap_model_weights`` on the backend thread between batches (the engine keeps serving).
  The membership is kept for the refits of its session; while it is joined, a thread probes the
  trainer's store at ``port + 1`` as the NeMo world's probe does (a TCP connect every
  ``store_probe_seconds`` of the controller: ``world.storeReachable``, from which the operator
  closes a session whose trainer is gone).
* **Refit**: a controller attempt from :mod:`~megafleet_engine.refit_attempts.sources.megatron_swap`
  with the attempt's phases, status and watchdog: suspend, one ``swap_model_weights`` on the backend
  thread, check the parameters' storage did not move, resume with the new version.
* **Leave**: drop the group (and end a swap of the session still running).

Invariants: only a backend holding a megatron-core model with megatron-core >= 0.17 joins (others
are refused before anything starts, :class:`CannotSwap`); a refit never joins (:class:`NotJoined`);
a swap cannot be interrupted, so a failed or timed-out one breaks the membership for good (the
trainer's ranks are stuck in the same collective): later refits of the session are refused and the
operator restarts the pod. Importing this module does not import torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Literal, Protocol

from megafleet_engine.refit_attempts import controller, memberships, phases
from megafleet_engine.refit_attempts.sources import megatron_swap
from megafleet_protocol import vocabulary

if TYPE_CHECKING:
    from megafleet_engine import engine as engine_module

__all__ = [
    "CannotSwap",
    "JoinRequest",
    "NativeRefits",
    "NotJoined",
    "Receiver",
    "RefitGroup",
    "RefitRequest",
    "receiver_of",
]

log = logging.getLogger(__name__)

CopyBackend = Literal["gloo", "nccl"]


class RefitGroup(Protocol):
    """The trainer's refit group as this rank joined it (the megatron backend's
    :class:`~megafleet_engine.backends.megatron.native_refit.RefitGroup`)."""

    def prepare(self) -> None:
        """``prepare_swap_model_weights`` (collective; on the backend thread)."""

    def swap(self) -> tuple[int, int]:
        """One ``swap_model_weights`` (collective; on the backend thread): tensors and bytes written."""
        ...

    def close(self) -> None:
        """Leave the group (idempotent, any thread)."""


class Receiver(Protocol):
    """A backend's model as a destination of megatron-core's refit
    (:meth:`~megafleet_engine.backends.megatron.MegatronBackend.native_receiver`)."""

    def unsupported(self) -> str | None:
        """Why it cannot take part (megatron-core too old, naming its version), or ``None``."""
        ...

    def connect(
        self,
        *,
        address: str,
        port: int,
        world_size: int,
        rank: int,
        rank_offset: int,
        copy_backend: CopyBackend,
        timeout_seconds: float,
    ) -> RefitGroup:
        """Join the refit group (blocks until every rank of both sides joined)."""
        ...


def receiver_of(backend: Any) -> Receiver | None:
    """The backend's megatron-core receiver, or ``None`` for a backend without a megatron-core model."""
    factory = getattr(backend, "native_receiver", None)
    return factory() if callable(factory) else None


class CannotSwap(controller.Refused):
    """This engine cannot take megatron-core's refit (no megatron-core model, or megatron-core < 0.17)."""


class NotJoined(controller.NotJoined):
    """A megatron refit on a rank that holds no joined refit group for its session."""


@dataclasses.dataclass(frozen=True)
class JoinRequest:
    """``POST /v1/refit/megatron/join``: join the trainer's refit group for ``session`` as rank
    ``rank_offset + local rank`` of ``world_size`` (trainer ranks ``0 .. trainer_world_size - 1``
    first); the store listens at ``port + 1``."""

    session: str
    address: str
    port: int
    world_size: int
    rank_offset: int
    trainer_world_size: int
    copy_backend: CopyBackend = "nccl"
    timeout_seconds: float = 240.0

    def rank(self, local_rank: int) -> int:
        """This process's rank in the group (:class:`ValueError`: not an inference rank of it)."""
        rank = self.rank_offset + local_rank
        if not self.trainer_world_size <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} (rankOffset {self.rank_offset} + local rank {local_rank}) is not an inference "
                f"rank of the refit group: those are {self.trainer_world_size} .. {self.world_size - 1}"
            )
        if self.port + 1 > 65535:
            raise ValueError(f"the refit group's store listens at port + 1, and {self.port} + 1 is no port")
        return rank


@dataclasses.dataclass(frozen=True)
class RefitRequest:
    """``POST /v1/refit/megatron``: one ``swap_model_weights`` to ``version`` over ``session``'s group."""

    version: int
    session: str
    timeout_seconds: float = 300.0
    suspend_mode: vocabulary.InFlightMode = "drain"
    kv_cache_mode: vocabulary.KvCacheMode | None = None
    staging: vocabulary.StagingMode = "off"
    integrity: vocabulary.Integrity = "none"  # checksum: every rank digests its parameters after the swap


class _Membership:
    """One join of a trainer's refit group (its thread's outcome) and the swaps made over it;
    implements :class:`~megafleet_engine.refit_attempts.sources.megatron_swap.Swappable`.
    ``phase`` and ``error`` change under ``lock``."""

    def __init__(self, request: JoinRequest, rank: int) -> None:
        self.request = request
        self.rank = rank
        self.lock = threading.Lock()
        self.phase: Literal["joining", "joined", "failed", "left"] = "joining"
        self.error: str | None = None
        self.group: RefitGroup | None = None
        self.swapping = False
        self.aborted = threading.Event()
        self.store_reachable: bool | None = None  # the last probe of the trainer's store; None: not probed yet

    def snapshot(self) -> memberships.WorldSnapshot:
        with self.lock:
            return memberships.WorldSnapshot(
                self.request.session, self.phase, self.rank, None, self.error, self.store_reachable
            )

    def probe_store(self, every_seconds: float) -> None:
        """The store probe's thread, while this membership is joined: every ``every_seconds``, whether
        the trainer's store (``port + 1``, megatron-core's refit store) still accepts a connection.
        A plain connect, never a call on the store the group was built over."""
        address, port = self.request.address, self.request.port + 1
        while self.snapshot().phase == "joined":
            reachable = memberships.store_listening(address, port, timeout=memberships.STORE_PROBE_TIMEOUT_SECONDS)
            with self.lock:
                self.store_reachable = reachable
            if self.aborted.wait(every_seconds):
                return

    def swap(self) -> tuple[int, int]:
        """The attempt's swap, on the backend thread."""
        with self.lock:
            group = self.group
            if group is None or self.phase != "joined":
                raise controller.Refused(f"the refit group of session {self.request.session!r} is {self.phase}")
            self.swapping = True
        try:
            return group.swap()
        finally:
            with self.lock:
                self.swapping = False

    def fail(self, reason: str) -> None:
        """A swap over this group failed or was abandoned (any thread): the membership is broken
        (the trainer's ranks are in the same collective) and the group is closed off this thread."""
        self.end("failed", f"a swap failed, the group cannot be reused: {reason}")

    def end(self, phase: Literal["failed", "left"], error: str | None = None) -> None:
        """Mark the membership ended and close its group on a thread of its own (a swap or prepare
        may still hold it on the backend thread; closing unblocks it)."""
        self.aborted.set()
        with self.lock:
            if self.phase in ("failed", "left"):
                return
            self.phase, self.error = phase, error
            group, self.group = self.group, None
        if group is not None:
            threading.Thread(target=group.close, name="megafleet-megatron-leave", daemon=True).start()


class NativeRefits:
    """The megatron-native refits of one engine process: at most one membership at a time.

    Args:
        refits: the process's refit controller (its attempts run the swaps; its rank is this
            process's rank inside its shard).
    """

    def __init__(self, refits: controller.RefitController) -> None:
        self.refits = refits
        self._lock = threading.Lock()
        self._membership: _Membership | None = None

    @property
    def engine(self) -> engine_module.Engine:
        return self.refits.engine

    def receiver(self) -> Receiver:
        """The backend's receiver; :class:`CannotSwap` when it has none or megatron-core cannot."""
        receiver = receiver_of(self.engine.backend)
        if receiver is None:
            name = type(self.engine.backend).__name__
            raise CannotSwap(
                f"this engine's backend ({name}) holds no megatron-core model and cannot take megatron-core's "
                "swap_model_weights; use the megatron backend, or the nemo protocol"
            )
        reason = receiver.unsupported()
        if reason is not None:
            raise CannotSwap(reason)
        return receiver

    def join(self, request: JoinRequest, loop: asyncio.AbstractEventLoop) -> memberships.WorldSnapshot:
        """Join the trainer's refit group for ``request.session`` on a thread of its own and prepare
        the plan with it, without suspending the engine; returns at once.

        The same session again while it joins or is joined answers its status; a join for another
        session leaves the old group first. Raises :class:`CannotSwap`, :class:`ValueError` (a rank
        outside the inference ranks), :class:`~megafleet_engine.refit_attempts.controller.Busy` while
        a refit runs and :class:`~megafleet_engine.refit_attempts.controller.Refused` when the engine failed.
        """
        receiver = self.receiver()
        rank = request.rank(self.refits.rank)
        with self._lock:
            current = self._membership
            if current is not None and current.request.session == request.session:
                snapshot = current.snapshot()
                if snapshot.phase in ("joining", "joined"):
                    return snapshot
            if self.refits.running:
                raise controller.Busy(self.refits.snapshot())
            if self.engine.state == "failed":
                raise controller.Refused(f"the engine failed ({self.engine.last_error}); it cannot join a refit group")
            membership = _Membership(request, rank)
            self._membership = membership
        if current is not None:
            current.end("left", f"another session ({request.session!r}) joined")
        thread = threading.Thread(
            target=self._join, args=(membership, receiver, loop), name="megafleet-megatron-join", daemon=True
        )
        thread.start()
        return membership.snapshot()

    def _join(self, membership: _Membership, receiver: Receiver, loop: asyncio.AbstractEventLoop) -> None:
        """The join's thread: the group (a rendezvous of every rank), then the plan (collective, on
        the backend thread), both within the join's timeout."""
        request = membership.request
        deadline = time.monotonic() + request.timeout_seconds
        try:
            group = receiver.connect(
                address=request.address,
                port=request.port,
                world_size=request.world_size,
                rank=membership.rank,
                rank_offset=request.rank_offset,
                copy_backend=request.copy_backend,
                timeout_seconds=request.timeout_seconds,
            )
            with membership.lock:
                ended = membership.phase != "joining"
                if not ended:
                    membership.group = group
            if ended:  # left (or another session joined) while connecting
                group.close()
                return
            _on_backend(self.engine, loop, group.prepare, deadline - time.monotonic(), "preparing the reshard plan")
        except Exception as error:
            message = str(error) or type(error).__name__
            if not isinstance(error, controller.Refused | TimeoutError):
                log.exception("joining the refit group of session %s raised", request.session)
                message = f"{type(error).__name__}: {message}"
            log.error("joining the refit group of session %s failed: %s", request.session, message)
            membership.end("failed", message)
            return
        with membership.lock:
            joined = membership.phase == "joining"
            if joined:
                membership.phase = "joined"
        if not joined:
            return
        log.info(
            "joined the refit group of session %s as rank %d of %d (%s copy service)",
            request.session, membership.rank, request.world_size, request.copy_backend,
        )  # fmt: skip
        membership.probe_store(self.refits.store_probe_seconds)  # this thread probes until the membership ends

    def world(self) -> memberships.WorldSnapshot | None:
        """The last join, if any."""
        with self._lock:
            membership = self._membership
        return membership.snapshot() if membership is not None else None

    def refit(self, request: RefitRequest, loop: asyncio.AbstractEventLoop) -> phases.Snapshot:
        """Start one swap over the group joined for ``request.session`` as a controller attempt;
        :class:`NotJoined` when this rank holds no joined group for it (never joins), else what
        :meth:`~megafleet_engine.refit_attempts.controller.RefitController.start` raises."""
        self.receiver()
        with self._lock:
            membership = self._membership
        if membership is None:
            raise NotJoined("this rank has not joined a refit group: call POST /v1/refit/megatron/join first")
        snapshot = membership.snapshot()
        if snapshot.session != request.session:
            raise NotJoined(
                f"this rank joined the refit group of session {snapshot.session!r}, not {request.session!r}"
            )
        if snapshot.phase != "joined":
            detail = f": {snapshot.error}" if snapshot.error else ""
            raise NotJoined(f"this rank's refit group for session {request.session!r} is {snapshot.phase}{detail}")
        swap = megatron_swap.SwapRequest(
            version=request.version,
            session=request.session,
            rank=membership.rank,
            world_size=membership.request.world_size,
            group=membership,
            timeout_seconds=request.timeout_seconds,
            suspend_mode=request.suspend_mode,
            kv_cache_mode=request.kv_cache_mode,
            staging=request.staging,
            integrity=request.integrity,
        )
        return self.refits.start(swap, loop)

    def leave(self, session: str) -> memberships.WorldSnapshot | None:
        """Leave ``session``'s group (a swap of it still running is aborted first); idempotent. Returns
        the membership as it ends, or ``None`` when this rank holds none for ``session``."""
        with self._lock:
            membership = self._membership
        if membership is None or membership.request.session != session:
            return None
        with membership.lock:
            swapping = membership.swapping
        membership.end("left")
        if swapping:  # its group is closed above: the attempt fails now, the swap's thread once unblocked
            self.refits.abort(f"the refit group of session {session!r} was left")
        return membership.snapshot()

    def close(self) -> None:
        """Engine shutdown: leave the group, if any."""
        with self._lock:
            membership = self._membership
        if membership is not None:
            membership.end("left", "the engine is stopping")


def _on_backend(
    engine: engine_module.Engine, loop: asyncio.AbstractEventLoop, call: Any, timeout: float, what: str
) -> None:
    """Run ``call`` on the backend thread (between batches) and wait up to ``timeout`` seconds."""
    coroutine = engine.run_exclusive(call)
    try:
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
    except RuntimeError:  # the loop is closed: the agent is stopping
        coroutine.close()
        raise controller.Refused(f"the agent is stopping; {what} did not run") from None
    try:
        future.result(timeout=max(timeout, 0.0))
    except concurrent.futures.TimeoutError:
        if future.done():
            raise
        future.cancel()
        raise TimeoutError(f"the join's deadline passed while {what}") from None
