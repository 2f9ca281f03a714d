"""One engine's refits: accept a request, run it as an attempt on its own thread, report it.

Called by the agent's refit routes (:mod:`megafleet_engine.agent_server`): one :class:`RefitController`
per engine process. :meth:`RefitController.start` returns at once; the attempt runs on a thread of
its own (the HTTP server never waits on a collective) through the phases ``suspending``, ``joining``
or ``applying``, ``receiving``, ``resuming``, and a :class:`Watchdog` thread ends it at its deadline.
docs/refit-protocol.md ("An attempt on the engine") tells each phase.

Invariants: nothing is received or written before the suspend ended, so no response comes from two
versions; the engine resumes only once every parameter of the version is written in place (and, on a
shard of several ranks, every rank says so); any failure, the deadline or an abort leaves the engine
``stale`` and the group aborted, never parked; once any weight was written the engine is *dirty* and
only a later complete refit brings it back. Only a successful refit parks its communicator for the
next one, and the trainer hears ``done`` only after the engine serves the version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from megafleet_engine.refit_runner import progress, watchdog
from megafleet_protocol import vocabulary
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine import engine as engine_module
    from megafleet_engine import metrics as metrics_module
    from megafleet_engine.backends import base
    from megafleet_protocol.refit import communicator, nemo, receiver

__all__ = [
    "Busy",
    "CheckpointRequest",
    "NemoJoinRequest",
    "NemoRequest",
    "NotJoined",
    "RefitController",
    "Refused",
    "RendezvousRequest",
    "Request",
    "WorldSnapshot",
    "store_listening",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
MIB = 2**20
SESSION_CHECK_SECONDS = 5.0
"""Bound of asking a parked communicator's store for the trainer's session (it answers at once or is gone)."""
STORE_PROBE_SECONDS = 10.0
"""Seconds between probes of the trainer's store while this rank holds a joined world (the operator
closes the session once every member found the store unreachable for a minute)."""
STORE_PROBE_TIMEOUT_SECONDS = 2.0
"""How long one probe may wait for the store to accept a connection."""


@dataclasses.dataclass(frozen=True)
class RendezvousRequest:
    """Receive ``version`` from the trainer's world (``POST /v1/refit/prepare``)."""

    version: int
    address: str
    port: int
    world_size: int
    rank_offset: int  # global rank of the shard's rank 0
    trainer_world_size: int = 1
    transport: vocabulary.Transport = "broadcast"
    bucket_size_mib: int = 1024
    timeout_seconds: float = 300.0
    suspend_mode: vocabulary.SuspendMode = "drain"
    kv_cache_mode: vocabulary.KvCacheMode | None = None
    local_address: str | None = None  # where this rank's gloo transport binds; None: the route to the trainer

    @property
    def key(self) -> tuple[object, ...]:
        """What makes two requests the same attempt (a repeated call is answered, not rerun)."""
        return ("rendezvous", self.version, self.address, self.port, self.world_size, self.rank_offset)


@dataclasses.dataclass(frozen=True)
class CheckpointRequest:
    """Load ``version`` from the checkpoint at ``path`` (``POST /v1/refit/checkpoint``)."""

    version: int
    path: str
    timeout_seconds: float = 300.0
    suspend_mode: vocabulary.SuspendMode = "drain"
    kv_cache_mode: vocabulary.KvCacheMode | None = None

    @property
    def key(self) -> tuple[object, ...]:
        return ("checkpoint", self.version, self.path)


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
    refit_info: tuple[tuple[str, tuple[int, ...], str], ...]
    bucket_bytes: int
    generation: vocabulary.NemoGeneration | None = None  # None: as the trainer's store tells
    timeout_seconds: float = 300.0
    suspend_mode: vocabulary.SuspendMode = "drain"
    kv_cache_mode: vocabulary.KvCacheMode | None = None
    local_address: str | None = None  # where this rank's gloo transport binds; None: the route to the trainer
    session: str | None = None  # set: receive over the world joined for this session, never join

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
        refit_info: tuple[tuple[str, tuple[int, ...], str], ...],
        bucket_bytes: int,
        timeout_seconds: float,
        suspend_mode: vocabulary.SuspendMode,
        kv_cache_mode: vocabulary.KvCacheMode | None,
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
        )


@dataclasses.dataclass(frozen=True)
class WorldSnapshot:
    """The membership of NeMo's world this rank joined for a session (``world`` in the refit status)."""

    session: str
    phase: str  # joining | joined | failed | left
    rank: int
    generation: vocabulary.NemoGeneration | None = None
    error: str | None = None
    store_reachable: bool | None = None  # the last probe of the trainer's store; None: not probed yet


class _World:
    """A join of NeMo's world (its thread's outcome): the request, and once joined the receiver.
    ``phase`` is read under the controller's lock; ``left`` is derived from the receiver's state."""

    def __init__(self, request: NemoJoinRequest, rank: int) -> None:
        self.request = request
        self.rank = rank
        self.phase = "joining"
        self.error: str | None = None
        self.receiver: nemo.NemoReceiver | None = None
        self.aborted = threading.Event()
        self.thread: threading.Thread | None = None
        self.store_reachable: bool | None = None  # written by the store probe's thread

    def snapshot(self) -> WorldSnapshot:
        phase = self.phase
        if phase == "joined" and (self.receiver is None or self.receiver.closed):
            phase = "left"
        generation = self.receiver.generation if self.receiver is not None else self.request.generation
        return WorldSnapshot(self.request.session, phase, self.rank, generation, self.error, self.store_reachable)


Request = RendezvousRequest | CheckpointRequest | NemoRequest


class Refused(errors.RefitError):
    """The engine cannot take a refit now (another one runs, or the engine failed)."""


class NotJoined(Refused):
    """A session refit on a rank that holds no joined membership of NeMo's world for it."""


class Busy(Refused):
    """Another attempt is running; ``snapshot`` is its status."""

    def __init__(self, snapshot: progress.Snapshot) -> None:
        super().__init__(f"a refit to weight version {snapshot.version} is {snapshot.phase}")
        self.snapshot = snapshot


class RefitController:
    """The refits of one engine process: at most one attempt runs at a time.

    Args:
        engine: the engine whose weights are replaced.
        rank: this process's rank inside its shard (``MEGAFLEET_RANK`` + local rank); its rank in
            the trainer+fleet world is the request's ``rank_offset`` plus this.
        metrics: where refit durations are recorded, if anywhere.
    """

    def __init__(
        self, engine: engine_module.Engine, *, rank: int = 0, metrics: metrics_module.Metrics | None = None
    ) -> None:
        self.engine = engine
        self.rank = rank
        self.metrics = metrics
        self._lock = threading.Lock()
        self._attempt: _Attempt | None = None
        self._dirty = False
        self._parked: _Parked | _Joined | None = None  # kept by the last successful refit
        self._sink: receiver.Sink | None = None  # the engine's sink, nothing written (built once)
        self._pointers: dict[str, int] | None = None  # live storage addresses, as last verified
        self._world: _World | None = None  # the last join of NeMo's world (POST /v1/refit/nemo/join)
        self.store_probe_seconds = STORE_PROBE_SECONDS  # shorter in tests

    @property
    def dirty(self) -> bool:
        """Weights were written by an attempt that did not complete: the engine holds no one version."""
        with self._lock:
            return self._dirty

    @property
    def running(self) -> bool:
        with self._lock:
            return self._attempt is not None and not self._attempt.record.finished

    def snapshot(self) -> progress.Snapshot:
        with self._lock:
            attempt = self._attempt
        return attempt.record.snapshot() if attempt is not None else progress.Snapshot()

    def wait_settled(self, timeout: float) -> bool:
        """Wait until the last attempt's thread has ended, not just its outcome been decided (an
        aborted attempt's thread can stay blocked in a gloo wait until its deadline; it writes
        nothing more meanwhile). For orderly shutdown and tests; returns whether it ended."""
        with self._lock:
            attempt = self._attempt
        return attempt is None or attempt.join(timeout)

    def start(self, request: Request, loop: asyncio.AbstractEventLoop) -> progress.Snapshot:
        """Start an attempt for ``request`` (on ``loop``, the agent's event loop, engine calls run).

        The same request again (same version and rendezvous, or the same checkpoint) while it runs
        or after it succeeded returns its status instead of starting it twice; a failed one is
        retried. Raises :class:`Busy` while another attempt runs, :class:`Refused` when the engine
        failed, and :class:`ValueError` for a request whose ranks do not fit this process.
        """
        if isinstance(request, RendezvousRequest):
            rendezvous = _rendezvous(request)
            rendezvous.group_rank(request.rank_offset + self.rank)  # ValueError: not a fleet rank
        elif isinstance(request, NemoRequest):
            self._check_nemo(request)
        with self._lock:
            current = self._attempt
            if current is not None:
                snapshot = current.record.snapshot()
                if current.request.key == request.key and snapshot.phase != "failed":
                    return snapshot
                if snapshot.phase not in ("succeeded", "failed"):
                    raise Busy(snapshot)
            if self.engine.state == "failed":
                raise Refused(f"the engine failed ({self.engine.last_error}); a refit cannot repair it")
            attempt = _Attempt(self, request, loop, parked=self._parked)
            self._parked = None  # the attempt reuses it or closes it, on its own thread
            self._attempt = attempt
        attempt.start()
        return attempt.record.snapshot()

    def join(self, request: NemoJoinRequest) -> WorldSnapshot:
        """Join NeMo's world for ``request.session`` on a thread of its own (the trainer's store master
        waits for every rank, so the join takes as long as the slowest rank) without suspending the
        engine, and keep the membership for that session's refits. Returns at once.

        The same session again while it joins or is joined answers its status; a join for another
        session leaves the old world first. Raises :class:`Busy` while a refit runs and
        :class:`ValueError` for a rank outside NeMo's inference ranks."""
        request.world(self.rank)  # ValueError: not an inference rank
        with self._lock:
            current = self._world
            if current is not None and current.request.session == request.session:
                snapshot = current.snapshot()
                if snapshot.phase in ("joining", "joined"):
                    return snapshot
            if self._attempt is not None and not self._attempt.record.finished:
                raise Busy(self._attempt.record.snapshot())
            if self.engine.state == "failed":
                raise Refused(f"the engine failed ({self.engine.last_error}); it cannot join NeMo's world")
            world = _World(request, request.rank_offset + self.rank)
            self._world = world
        if current is not None:
            current.aborted.set()
        self._discard_parked()  # another world (or a failed join of this one): NeMo's world cannot be rejoined
        world.thread = threading.Thread(target=self._join, args=(world,), name="megafleet-nemo-join", daemon=True)
        world.thread.start()
        return world.snapshot()

    def world(self) -> WorldSnapshot | None:
        """The last join of NeMo's world, if any."""
        with self._lock:
            world = self._world
            return world.snapshot() if world is not None else None

    def joined(self, session: str | None) -> NemoJoinRequest:
        """The join request of the world this rank holds for ``session`` (any session when ``None``);
        raises :class:`NotJoined` when it holds none (never joined, still joining, failed or left)."""
        with self._lock:
            world = self._world
            snapshot = world.snapshot() if world is not None else None
        if world is None or snapshot is None:
            raise NotJoined("this rank has not joined NeMo's world: call POST /v1/refit/nemo/join first")
        if session is not None and world.request.session != session:
            raise NotJoined(f"this rank joined NeMo's world for session {world.request.session!r}, not {session!r}")
        if snapshot.phase != "joined":
            detail = f": {snapshot.error}" if snapshot.error else ""
            raise NotJoined(
                f"this rank's membership of NeMo's world for session {snapshot.session!r} is {snapshot.phase}{detail}"
            )
        return world.request

    def _join(self, world: _World) -> None:
        """The join's thread: rendezvous, communicator, warm-up; the receiver is parked as a NeMo
        refit's would be, so the session's first refit reuses it (``reused``, no ``join`` phase)."""
        from megafleet_protocol.refit import communicator, nemo

        request = world.request
        try:
            device = self._fresh_sink().device
            local_address = request.local_address or communicator.local_address_towards(request.address)
            receiver = nemo.NemoReceiver.connect(
                request.world(self.rank),
                backend="nccl" if device.type == "cuda" else "gloo",
                device=device,
                deadline=communicator.Deadline(request.timeout_seconds),
                aborted=world.aborted,
                generation=request.generation,
                local_address=local_address,
            )
        except Exception as error:
            message = str(error) or type(error).__name__
            if not isinstance(error, errors.RefitError):
                log.exception("joining NeMo's world for session %s raised", request.session)
                message = f"{type(error).__name__}: {message}"
            with self._lock:
                if world.phase != "left":  # a leave during the join is not a failure
                    world.phase, world.error = "failed", message
            log.error("joining NeMo's world for session %s failed: %s", request.session, message)
            return
        key = ("nemo", request.world(self.rank), local_address, request.generation)
        with self._lock:
            current = self._world is world and not world.aborted.is_set()
        if not current:
            receiver.close()
            return
        self._park(_Joined(key, receiver))  # a refit built by request.refit() computes this key: it never joins
        with self._lock:
            world.request = dataclasses.replace(request, local_address=local_address)
            world.receiver, world.phase = receiver, "joined"
        log.info(
            "joined NeMo's world for session %s as rank %d of %d (%s)",
            request.session, world.rank, request.world_size, receiver.generation,
        )  # fmt: skip
        probe = threading.Thread(target=self._probe_store, args=(world,), name="megafleet-store-probe", daemon=True)
        probe.start()

    def _probe_store(self, world: _World) -> None:
        """The store probe's thread, while ``world`` is joined: every ``store_probe_seconds``, whether
        the trainer's store still accepts a connection (NeMo keeps it alive for its whole run, so a
        store that does not is a trainer that is gone). A plain connect, never a call on the store
        client the joined group was built over."""
        address, port = world.request.address, world.request.port
        while world.snapshot().phase == "joined":
            reachable = store_listening(address, port, timeout=STORE_PROBE_TIMEOUT_SECONDS)
            with self._lock:
                world.store_reachable = reachable
            if world.aborted.wait(self.store_probe_seconds):
                return

    def leave(self, session: str) -> WorldSnapshot:
        """Drop this rank's membership of ``session``'s world (``POST /v1/refit/nemo/leave``): stop a
        join in progress, fail a refit running over it (the engine stays stale, as after any failed
        refit) and close the communicator; an engine with nothing running serves on. Idempotent: a
        session this rank does not hold answers ``left`` and changes nothing."""
        with self._lock:
            world, attempt = self._world, self._attempt
            if world is None or world.request.session != session:
                return WorldSnapshot(session, "left", self.rank)
            world.phase = "left"
        world.aborted.set()
        request = attempt.request if attempt is not None else None
        if attempt is not None and isinstance(request, NemoRequest) and request.session == session:
            attempt.abort(f"aborted: this rank left RefitSession {session}'s world", timed_out=False)
        with self._lock:
            parked = self._parked
            if isinstance(parked, _Joined) and parked.receiver is world.receiver:
                self._parked = None
            else:
                parked = None
        if parked is not None:
            parked.discard()
        if world.receiver is not None:
            world.receiver.close()
        log.info("left NeMo's world for session %s", session)
        return world.snapshot()

    def abort(self, reason: str) -> progress.Snapshot:
        """End the running attempt now (as the watchdog would), and close a parked transfer group
        (and a join of NeMo's world still in progress)."""
        with self._lock:
            attempt = self._attempt
            world = self._world
        if world is not None:
            world.aborted.set()
        if attempt is not None:
            attempt.abort(f"aborted: {reason}", timed_out=False)
        self._discard_parked()
        return self.snapshot()

    def _check_nemo(self, request: NemoRequest) -> None:
        """Refuse (:class:`ValueError`) a NeMo refit this rank cannot take, before it suspends anything:
        a rank outside NeMo's inference ranks, an unknown dtype, or a refit info that lacks a parameter
        this rank holds or gives one another shape. The trainer cannot hear the refusal (its broadcasts
        time out), so the world joined for earlier refits is left too."""
        from megafleet_protocol.refit import nemo

        request.world(self.rank)
        try:
            nemo.check_refit_info(request.specs(), self._fresh_sink().required())
        except errors.ManifestMismatch as error:
            if not self.running:
                self._discard_parked()
            raise ValueError(f"NeMo's refit info does not fit this engine: {error}") from None

    @property
    def parked(self) -> bool:
        """Whether a transfer group is parked for the next refit."""
        with self._lock:
            return self._parked is not None

    def close(self) -> None:
        """Engine shutdown: close the parked transfer group, if any, and stop a join in progress (a
        running attempt is left to its watchdog)."""
        with self._lock:
            world = self._world
        if world is not None:
            world.aborted.set()
        self._discard_parked()

    def _park(self, parked: _Parked | _Joined) -> None:
        with self._lock:
            old, self._parked = self._parked, parked
        if old is not None:
            old.discard()

    def _discard_parked(self) -> None:
        with self._lock:
            parked, self._parked = self._parked, None
        if parked is not None:
            parked.discard()

    def _mark_dirty(self, dirty: bool) -> None:
        with self._lock:
            self._dirty = dirty

    def _fresh_sink(self) -> receiver.Sink:
        """A sink over the engine's live parameters with nothing written; the parameters are
        looked up once per engine (a walk of the model is milliseconds on a large one)."""
        from megafleet_engine.refit_runner import sinks

        with self._lock:
            template = self._sink
        if template is None:
            template = sinks.sink_for(self.engine.backend)
            with self._lock:
                self._sink = template
        return template.fresh()

    def _live_pointers(self) -> dict[str, int]:
        """The parameters' storage addresses before a refit writes: those the last refit verified
        (nothing rebinds parameters between refits), read afresh the first time."""
        from megafleet_engine.refit_runner import sinks

        with self._lock:
            known = self._pointers
        return known if known is not None else sinks.pointers(self.engine.backend)

    def _verify_in_place(self, before: dict[str, int]) -> None:
        """Raise unless every parameter still has the storage it had ``before`` (a write rebound
        none: CUDA graphs captured on those addresses stay valid), and remember them."""
        from megafleet_engine.refit_runner import sinks

        after = sinks.pointers(self.engine.backend)
        _check_in_place(before, after)
        with self._lock:
            self._pointers = after


@dataclasses.dataclass(frozen=True)
class _Parked:
    """A communicator kept after a successful refit, the rendezvous it serves (rendezvous, this
    rank's global rank, the address its transport binds) and the manifest it took."""

    key: tuple[object, ...]
    comm: communicator.Communicator
    accepted: receiver.Accepted | None = None

    def discard(self) -> None:
        self.comm.discard()


@dataclasses.dataclass(frozen=True)
class _Joined:
    """Membership of NeMo's world kept after a successful NeMo refit (NeMo builds its world once per
    run and refits over it step after step; it cannot be rebuilt), and the world and bind address it serves."""

    key: tuple[object, ...]
    receiver: nemo.NemoReceiver

    def discard(self) -> None:
        self.receiver.close()


class _Attempt:
    """One refit attempt: its thread, watchdog, communicator and record."""

    def __init__(
        self,
        owner: RefitController,
        request: Request,
        loop: asyncio.AbstractEventLoop,
        *,
        parked: _Parked | _Joined | None = None,
    ) -> None:
        from megafleet_protocol.refit import communicator  # torch loads here, not at agent import

        self.owner = owner
        self.parked = parked  # taken (reused or closed) by the attempt's thread
        self._key: tuple[object, ...] | None = None  # the rendezvous key this attempt's communicator serves
        self.engine = owner.engine
        self.request = request
        self.loop = loop
        self.deadline = communicator.Deadline(request.timeout_seconds)
        if isinstance(request, RendezvousRequest):
            self.record = progress.Progress(
                version=request.version,
                source="rendezvous",
                transport=request.transport,
                rank=request.rank_offset + owner.rank,
                world_size=request.world_size,
            )
        elif isinstance(request, NemoRequest):
            self.record = progress.Progress(
                version=request.version,
                source="nemo",
                transport="broadcast",
                rank=request.rank_offset + owner.rank,
                world_size=request.world_size,
            )
        else:
            self.record = progress.Progress(version=request.version, source="checkpoint")
        self._joined: nemo.NemoReceiver | None = None  # this attempt's membership of NeMo's world
        self._comm: communicator.Communicator | None = None
        self._comm_lock = threading.Lock()
        self._received: receiver.Received | None = None  # what the transfer took in (rendezvous)
        self._told = False  # the trainer got this attempt's outcome
        self._aborted = threading.Event()  # the communicator's abort flag, also before it exists
        self._watchdog = watchdog.Watchdog(request.timeout_seconds, self._expire)
        self._thread = threading.Thread(target=self._run, name=f"megafleet-refit-{request.version}", daemon=True)

    def start(self) -> None:
        log.info("refit to weight version %d (%s) started", self.request.version, self._describe())
        self._watchdog.start()
        self._thread.start()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def abort(self, reason: str, *, timed_out: bool) -> None:
        """Fail the attempt now: mark the engine stale and tear its group down (any thread)."""
        if not self.record.finish(error=reason, timed_out=timed_out):
            return
        self.engine.mark("stale", reason)
        self._aborted.set()
        self._settle(ok=False)  # a following rank tells its first rank it does not hold the version
        with self._comm_lock:
            comm, joined = self._comm, self._joined
        if comm is not None:
            comm.abort()
        if joined is not None:
            joined.abort()
        self._observe(succeeded=False)
        log.error("refit to weight version %d failed: %s", self.request.version, reason)

    # -- the attempt's thread ------------------------------------------------------------------

    def _run(self) -> None:
        suspended: concurrent.futures.Future[None] | None = None
        try:
            if isinstance(self.request, RendezvousRequest):
                suspended = self._start_suspend()
                self._receive(self.request, suspended)
            elif isinstance(self.request, NemoRequest):
                suspended = self._start_suspend()
                self._receive_nemo(self.request, suspended)
            else:
                if self.parked is not None:  # another kind of refit: the next rendezvous joins afresh
                    self.parked.discard()
                    self.parked = None
                self._wait_suspended(self._start_suspend())
                self._load(self.request)
            self._commit()
        except Exception as error:
            self._report_failure(str(error) or type(error).__name__)
            self._fail(error)
        finally:
            if suspended is not None and not suspended.done():
                suspended.cancel()  # the join failed first; the engine stays closed (stale)
            self._watchdog.stop()
            if self.parked is not None:  # failed before it got to the join
                self.parked.discard()
                self.parked = None
            with self._comm_lock:
                comm, self._comm = self._comm, None
                joined, self._joined = self._joined, None
            if comm is not None:  # not parked: this attempt failed
                comm.close()
            if joined is not None:
                joined.close()

    def _start_suspend(self) -> concurrent.futures.Future[None]:
        """Start suspending the engine on the agent's loop (the suspend runs while the attempt
        joins the trainer's world; nothing is received or written before it ends)."""
        request = self.request
        if request.kv_cache_mode is not None:
            self.engine.kv_cache_mode = request.kv_cache_mode
        remaining = self.deadline.left("suspending the engine").total_seconds()

        async def suspend() -> None:
            with self.record.timed("suspend"):
                # hold: requests arriving meanwhile wait for the new version instead of a 503
                await self.engine.suspend(request.suspend_mode, timeout_seconds=remaining, hold=True)

        coroutine = suspend()
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        except RuntimeError:  # the loop is closed: the server is stopping
            coroutine.close()
            raise errors.RefitAborted("the agent is stopping; suspending did not run") from None

    def _wait_suspended(self, suspended: concurrent.futures.Future[None]) -> None:
        """Wait until the suspend started by :meth:`_start_suspend` ended, until the deadline."""
        try:
            suspended.result(timeout=self.deadline.left("suspending the engine").total_seconds())
        except TimeoutError as error:  # the drain's own timeout, or this wait's (the same class)
            if not suspended.done():
                raise errors.RefitTimeout("the refit's deadline passed while suspending") from None
            raise errors.RefitTimeout(f"suspending ({self.request.suspend_mode}) did not finish: {error}") from None

    def _receive(self, request: RendezvousRequest, suspended: concurrent.futures.Future[None]) -> None:
        from megafleet_protocol.refit import communicator, receiver

        self.record.enter("joining")
        sink = self.owner._fresh_sink()
        before = self.owner._live_pointers()
        rendezvous = _rendezvous(request)
        global_rank = request.rank_offset + self.owner.rank
        with self.record.timed("join"):
            local_address = request.local_address or communicator.local_address_towards(request.address)
            self._key = (rendezvous, global_rank, local_address)
            comm, accepted = self._take_parked(self._key)
            if comm is None:
                # a new group is built: its buffers come after whatever the suspend frees
                self._wait_suspended(suspended)
                comm = communicator.Communicator.connect(
                    rendezvous,
                    global_rank=global_rank,
                    backend="nccl" if sink.device.type == "cuda" else "gloo",
                    device=sink.device,
                    deadline=self.deadline,
                    local_address=local_address,
                    aborted=self._aborted,
                )
        with self._comm_lock:
            self._comm = comm
        if self.record.finished:  # aborted while joining: the abort did not see this group
            comm.abort()
            raise errors.RefitAborted("the refit was aborted while joining")
        self._received = receiver.receive(
            comm,
            sink,
            version=request.version,
            transport=request.transport,
            bucket_limit_bytes=request.bucket_size_mib * MIB,
            apply=self._apply,
            record=self.record,
            accepted=accepted,
            before_transfer=lambda: self._wait_suspended(suspended),
            after_writes=lambda: self.owner._verify_in_place(before),
        )

    def _take_parked(
        self, key: tuple[object, ...]
    ) -> tuple[communicator.Communicator | None, receiver.Accepted | None]:
        """The parked communicator, rearmed for this attempt, and the manifest it took, if it serves
        ``key`` and the trainer's store still answers with its session; else ``None`` (and the
        parked one is closed)."""
        parked, self.parked = self.parked, None
        if parked is None:
            return None, None
        if isinstance(parked, _Parked) and parked.key == key:
            try:
                parked.comm.rearm(self.deadline, self._aborted)
                parked.comm.check_session(SESSION_CHECK_SECONDS)
                return parked.comm, parked.accepted
            except errors.RefitError as error:
                log.info("not reusing the parked refit group: %s", error)
        parked.discard()
        return None, None

    def _park(self) -> tuple[communicator.Communicator | None, bool]:
        """Keep this attempt's communicator for the next refit (called once its version is served);
        returns it and whether it was parked (if not, the caller closes it after its last word)."""
        with self._comm_lock:
            comm, self._comm = self._comm, None
        if comm is None or self._key is None or not comm.healthy or comm.aborted:
            return comm, False
        accepted = self._received.accepted if self._received is not None else None
        self.owner._park(_Parked(self._key, comm, accepted))
        return comm, True

    def _receive_nemo(self, request: NemoRequest, suspended: concurrent.futures.Future[None]) -> None:
        """Join NeMo's world (or keep the membership of the last NeMo refit over the same world), then
        receive its packed broadcast into the engine's sink, in place, once the suspend ended."""
        from megafleet_engine.refit_runner import nemo_source
        from megafleet_protocol.refit import communicator, nemo

        self.record.enter("joining")
        sink = self.owner._fresh_sink()
        before = self.owner._live_pointers()
        world = request.world(self.owner.rank)
        local_address = request.local_address or communicator.local_address_towards(request.address)
        key = ("nemo", world, local_address, request.generation)
        parked, self.parked = self.parked, None
        joined = parked.receiver if isinstance(parked, _Joined) and parked.key == key else None
        if parked is not None and joined is None:
            parked.discard()
        self.record.set_reused(joined is not None)
        if joined is None and request.session is not None:
            raise errors.RefitError(
                f"this rank no longer holds NeMo's world for session {request.session!r}; a session refit never "
                "joins (NeMo cannot rebuild its collective)"
            )
        if joined is None:
            with self.record.timed("join"):
                self._wait_suspended(suspended)  # NCCL's buffers come after whatever the suspend frees
                joined = nemo.NemoReceiver.connect(
                    world,
                    backend="nccl" if sink.device.type == "cuda" else "gloo",
                    device=sink.device,
                    deadline=self.deadline,
                    aborted=self._aborted,
                    generation=request.generation,
                    local_address=local_address,
                )
        with self._comm_lock:
            self._joined, self._key = joined, key
        if self.record.finished:  # aborted while joining: the abort did not see this membership
            joined.abort()
            raise errors.RefitAborted("the refit was aborted while joining")
        self._wait_suspended(suspended)
        self.record.enter("receiving")
        with self.record.timed("receive"):
            stats = nemo_source.receive(
                joined,
                sink,
                specs=request.specs(),
                bucket_bytes=request.bucket_bytes,
                apply=self._apply,
                deadline=self.deadline,
            )
        self.record.count(
            bytes_received=stats.bytes_received, buckets=stats.buckets, tensors_written=stats.tensors_written
        )
        self.owner._verify_in_place(before)

    def _keep_joined(self) -> None:
        """Keep this attempt's membership of NeMo's world for the next NeMo refit over it."""
        with self._comm_lock:
            joined, self._joined = self._joined, None
        if joined is not None and self._key is not None:
            self.owner._park(_Joined(self._key, joined))

    def _load(self, request: CheckpointRequest) -> None:
        self.record.enter("applying")
        backend = self.engine.backend
        before = self.owner._live_pointers()
        with self.record.timed("apply"):
            self._apply(lambda: _load_checkpoint(backend, request.path))
        self.owner._verify_in_place(before)

    def _apply(self, write: Callable[[], int]) -> int:
        """Run ``write`` on the backend thread, unless the attempt ended meanwhile."""
        self.owner._mark_dirty(True)

        def guarded() -> int:
            if self.record.finished:
                raise errors.RefitAborted("the refit ended; no further weights are written")
            return write()

        return self._on_loop(self.engine.run_exclusive(guarded), "writing weights")

    def _settle(self, *, ok: bool) -> None:
        """On a model-parallel shard: agree with the other ranks that all hold the new version
        (the first rank asks, on the backend thread; a following rank only records ``ok``)."""
        if not self.engine.backend.spans_ranks:
            return
        settle = self.engine.backend.settle_weight_update
        version = self.request.version
        if not ok:
            settle(version, ok=False, timeout_seconds=0.0)
            return
        left = self.deadline.left("waiting for the shard's other ranks").total_seconds()
        agreed = self._on_loop(
            self.engine.run_exclusive(lambda: settle(version, ok=True, timeout_seconds=left)),
            "waiting for the shard's other ranks",
        )
        if not agreed:
            raise errors.RefitError(
                f"a rank of this shard does not hold weight version {version}; the shard stays stale"
            )

    def _commit(self) -> None:
        self._settle(ok=True)
        if not self.record.begin_commit():
            raise errors.RefitAborted("the refit ended before it could resume the engine")
        with self.record.timed("resume"):
            self.engine.resume(weight_version=self.request.version)
        self.owner._mark_dirty(False)
        namespace = self._namespace()
        self._keep_joined()  # before the success shows, as the communicator below
        comm, parked = self._park()  # before the success shows: the next refit's prepare finds the group parked
        self.record.finish(error=None)
        self._told = True
        if comm is not None and self._received is not None:  # the trainer learns it once this version serves
            # In this round's namespace, on the (now parked) store client: its calls are serialised
            # by torch, and a next attempt that took it already waits in slices of at most 1 s.
            _tell(comm, namespace, ok=True, bytes_received=self._received.nbytes)
        if comm is not None and not parked:
            comm.close()
        self._observe(succeeded=True)
        snapshot = self.record.snapshot()
        log.info(
            "refit to weight version %d succeeded in %.3f s (%s)",
            self.request.version,
            snapshot.duration_seconds or 0.0,
            ", ".join(f"{name} {seconds:.3f} s" for name, seconds in snapshot.phases),
        )

    def _namespace(self) -> str | None:
        with self._comm_lock:
            return self._comm.namespace if self._comm is not None else None

    def _report_failure(self, error: str) -> None:
        """Tell the trainer this attempt failed (once; best effort) while the communicator is this attempt's."""
        if self._told:
            return
        self._told = True
        with self._comm_lock:
            comm = self._comm
        if comm is not None:
            _tell(comm, comm.namespace, ok=False, error=error)

    def _fail(self, error: Exception) -> None:
        message = str(error) or type(error).__name__
        if not isinstance(error, errors.RefitError):
            log.exception("refit to weight version %d raised", self.request.version)
            message = f"{type(error).__name__}: {message}"
        self.abort(message, timed_out=isinstance(error, errors.RefitTimeout))

    def _expire(self) -> None:
        snapshot = self.record.snapshot()
        self.abort(
            f"the refit did not finish within timeoutSeconds={self.request.timeout_seconds:g} "
            f"(it was {snapshot.phase}); aborted by the watchdog",
            timed_out=True,
        )

    def _on_loop(self, coroutine: Coroutine[Any, Any, T], what: str) -> T:
        """Run an engine coroutine on the agent's event loop and wait for it until the deadline."""
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        except RuntimeError:  # the loop is closed: the server is stopping
            coroutine.close()
            raise errors.RefitAborted(f"the agent is stopping; {what} did not run") from None
        try:
            return future.result(timeout=self.deadline.left(what).total_seconds())
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TimeoutError (a drain that did not finish)
                raise
            future.cancel()
            raise errors.RefitTimeout(f"the refit's deadline passed while {what}") from None

    def _describe(self) -> str:
        request = self.request
        if isinstance(request, CheckpointRequest):
            return f"checkpoint {request.path}, timeout {request.timeout_seconds:g} s"
        if isinstance(request, NemoRequest):
            return (
                f"NeMo's collective at {request.address}:{request.port} as rank "
                f"{request.rank_offset + self.owner.rank} of {request.world_size}, {len(request.refit_info)} tensors "
                f"in buckets of {request.bucket_bytes} bytes, timeout {request.timeout_seconds:g} s"
            )
        return (
            f"{request.transport} from {request.address}:{request.port} as rank "
            f"{request.rank_offset + self.owner.rank} of {request.world_size}, timeout {request.timeout_seconds:g} s"
        )

    def _observe(self, *, succeeded: bool) -> None:
        if self.owner.metrics is not None:
            self.owner.metrics.observe_refit(self.record.elapsed, succeeded=succeeded)


def store_listening(address: str, port: int, *, timeout: float) -> bool:
    """Whether the trainer's store at ``address:port`` accepts a TCP connection within ``timeout``."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def _rendezvous(request: RendezvousRequest) -> communicator.Rendezvous:
    from megafleet_protocol.refit import communicator

    return communicator.Rendezvous(
        request.address, request.port, request.world_size, trainer_world_size=request.trainer_world_size
    )


def _load_checkpoint(backend: base.Backend, path: str) -> int:
    backend.load_checkpoint(path)
    return len(backend.parameters())


def _check_in_place(before: dict[str, int], after: dict[str, int]) -> None:
    moved = sorted(name for name in before if after.get(name) != before[name])
    if moved or set(after) != set(before):
        raise errors.RefitError(f"parameters were rebound instead of written in place, e.g. {moved[:3]}")


def _tell(
    comm: communicator.Communicator, namespace: str | None, *, ok: bool, error: str = "", bytes_received: int = 0
) -> None:
    """Report the outcome (``done``) to the trainer in the round ``namespace`` (``None`` or empty: no
    round was opened, nothing to tell); best effort (it may be gone, or the store unreachable)."""
    from megafleet_protocol.refit import wire

    if not namespace:
        return
    done = wire.Done(ok=ok, error=error, bytes_received=bytes_received)
    try:
        comm.set(wire.done_key(comm.group_rank), done.encode(), namespace=namespace)
    except RuntimeError as error:
        log.debug("could not report the refit outcome to the trainer: %s", error)
