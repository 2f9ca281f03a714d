"""One engine's refits: admit a request, run it as an attempt, report it; and NeMo's joined world.

Called by the agent's refit routes (:mod:`megafleet_engine.agent_server`) in each engine rank's process:
one :class:`RefitController` per process. It decides what may start (at most one attempt at a
time; none on a failed engine; a repeated request answers its status), hands an admitted request's
source (:mod:`~megafleet_engine.refit_attempts.sources`) to an attempt
(:mod:`~megafleet_engine.refit_attempts.attempt`, which runs on a thread of its own) together with
what the last successful refit parked, and keeps the weight target
(:mod:`~megafleet_engine.refit_attempts.weight_target`: dirty, parked) and the membership of NeMo's
world joined for a session (:mod:`~megafleet_engine.refit_attempts.nemo_world`), with the stage
communicators of NeMo's M-to-N reshard joined beside it (:mod:`~megafleet_engine.refit_attempts.reshard_stages`).
:meth:`RefitController.start` returns at once.

Each attempt's modes (:meth:`RefitController.modes`: drain, abort or keep; in place or staged) are
decided when it is admitted, from the request and what the engine can do; a staged attempt writes
into the staging target (:class:`~megafleet_engine.refit_attempts.weight_target.StagingTarget`).

Invariants: nothing is written into the live weights before the engine was suspended or paused at a
step boundary, and every step is stamped with the version that computed it, so no token comes from a
mixture; the new version serves only once every parameter of it is written (and, on a shard of several
ranks, every rank says so); a failure, the deadline or an abort leaves the group aborted, never
parked, and the engine ``stale`` unless nothing of the new version touched its live weights and it
staged (it serves the old version on); once any live weight was written the engine is *dirty* and
only a later complete refit brings it back. Only a successful refit parks its communicator for the
next one, and the trainer hears ``done`` only after the engine serves the version.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from megafleet_engine.refit_attempts import attempt as attempt_module
from megafleet_engine.refit_attempts import (
    memberships,
    modes,
    nemo_world,
    phases,
    reshard_stages,
    sources,
    weight_target,
)
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine import engine as engine_module
    from megafleet_engine import metrics as metrics_module
    from megafleet_engine.refit_attempts.sources import nemo_collective

__all__ = ["Busy", "NotJoined", "NotStaged", "RefitController", "Refused"]

log = logging.getLogger(__name__)


class Refused(errors.RefitError):
    """The engine cannot take a refit now (another one runs, or the engine failed)."""


class NotJoined(Refused):
    """A session refit on a rank that holds no joined membership of NeMo's world for it."""


class NotStaged(Refused):
    """An operator's commit for a version no attempt of this engine waits for (409 ``not_staged``)."""


class Busy(Refused):
    """Another attempt is running; ``snapshot`` is its status."""

    def __init__(self, snapshot: phases.Snapshot) -> None:
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
        self.target = weight_target.LiveTarget(engine, rank)
        self.staging_target = weight_target.StagingTarget(self.target)
        self._lock = threading.Lock()
        self._attempt: attempt_module.Attempt | None = None
        self._world: nemo_world.NemoMembership | None = None  # the last join of NeMo's world
        self.store_probe_seconds = memberships.STORE_PROBE_SECONDS  # shorter in tests

    @property
    def dirty(self) -> bool:
        """Weights were written by an attempt that did not complete: the engine holds no one version."""
        return self.target.dirty

    @property
    def parked(self) -> bool:
        """Whether a transfer group is parked for the next refit."""
        return self.target.parked

    @property
    def running(self) -> bool:
        with self._lock:
            return self._attempt is not None and not self._attempt.record.finished

    def snapshot(self) -> phases.Snapshot:
        with self._lock:
            attempt = self._attempt
        return attempt.record.snapshot() if attempt is not None else phases.Snapshot()

    def wait_settled(self, timeout: float) -> bool:
        """Wait until the last attempt's thread has ended, not just its outcome been decided (an
        aborted attempt's thread can stay blocked in a gloo wait until its deadline; it writes
        nothing more meanwhile). For orderly shutdown and tests; returns whether it ended."""
        with self._lock:
            attempt = self._attempt
        return attempt is None or attempt.join(timeout)

    def start(self, request: sources.Request, loop: asyncio.AbstractEventLoop) -> phases.Snapshot:
        """Start an attempt for ``request`` (on ``loop``, the agent's event loop, engine calls run).

        The same request again (same version and rendezvous, or the same checkpoint) while it runs
        or after it succeeded returns its status instead of starting it twice; a failed one is
        retried. Raises :class:`Busy` while another attempt runs, :class:`Refused` when the engine
        failed, and :class:`ValueError` for a request whose ranks do not fit this process.
        """
        try:
            source = request.source(self.target)
        except sources.Unfit as error:
            if not self.running:
                self.target.discard_parked()
                with self._lock:
                    world = self._world
                if world is not None:  # they serve NeMo's world, which is gone with what was parked
                    world.leave_stages(str(error))
            raise
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
            chosen = self.modes(request)
            target = self.staging_target if chosen.staged else self.target
            # the attempt reuses what is parked or closes it, on its own thread
            parked = self.target.take_parked()
            attempt = attempt_module.Attempt(source, target, loop, chosen, parked=parked, metrics=self.metrics)
            self._attempt = attempt
        attempt.start()
        return attempt.record.snapshot()

    def modes(self, request: sources.Request) -> modes.Modes:
        """What an attempt of ``request`` does with the sequences in flight and where it writes, on
        this engine (its backend's ``keep_modes``, its staging copy)."""
        engine = self.engine
        return modes.resolve(
            in_flight=request.suspend_mode,
            kv_cache_mode=request.kv_cache_mode or engine.kv_cache_mode,
            staging=request.staging,
            backend=backend_name(engine.backend),
            keep_modes=engine.backend.keep_modes,
            copy=engine.staging,
            commit=request.commit,
        )

    def commit(self, version: int) -> phases.Snapshot:
        """The operator's commit of ``version`` (``POST /v1/refit/commit``): the attempt staged for it
        switches. Idempotent (an attempt that serves it answers its status); raises :class:`NotStaged`
        when no attempt to ``version`` waits for the operator's commit."""
        with self._lock:
            attempt = self._attempt
        if attempt is None or attempt.request.version != version:
            last = "no refit ran" if attempt is None else f"the last refit is to version {attempt.request.version}"
            raise NotStaged(f"no refit to weight version {version} is staged on this rank ({last})")
        return attempt.commit()

    def join(self, request: nemo_collective.NemoJoinRequest) -> memberships.WorldSnapshot:
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
            world = nemo_world.NemoMembership(request, self.rank, self._lock)
            self._world = world
        if current is not None:
            current.aborted.set()
            current.leave_stages(f"another session ({request.session!r}) joined")
        self.target.discard_parked()  # another world (or a failed join of this one): NeMo's world cannot be rejoined
        world.start(self.target, current=self._holds, probe_seconds=lambda: self.store_probe_seconds)
        return world.snapshot()

    def join_stages(self, request: reshard_stages.StageJoinRequest) -> memberships.WorldSnapshot:
        """Join the stage communicators of NeMo's M-to-N reshard for ``request.session`` on a thread of
        its own, without suspending the engine, and hang them on the session's NeMo world (which this
        rank must hold: :class:`NotJoined`). Returns at once with the world's status.

        The same request again while it joins or is joined answers its status; another one (NeMo's
        rebuild) leaves the old stages first. Raises :class:`Busy` while a refit runs and
        :class:`ValueError` for a rank outside the stages' inference ranks."""
        request.rank(self.rank)  # ValueError: not an inference rank of the stages
        self.joined(request.session)  # NotJoined: NeMo joins its world before the stages
        with self._lock:
            world = self._world
            if world is None or world.request.session != request.session:
                raise NotJoined(f"this rank no longer holds NeMo's world for session {request.session!r}")
            current = world.stages
            if current is not None and current.request == request and current.snapshot().phase in ("joining", "joined"):
                return world.snapshot()
            if self._attempt is not None and not self._attempt.record.finished:
                raise Busy(self._attempt.record.snapshot())
            stages = reshard_stages.StageMembership(request, self.rank)
            world.stages = stages
        if current is not None:
            current.leave("the stage communicators were joined again")
        stages.start(self.target)
        return self.world() or world.snapshot()

    def _holds(self, world: nemo_world.NemoMembership) -> bool:
        """Whether ``world`` is still the membership this rank keeps (not left, not replaced)."""
        with self._lock:
            return self._world is world and not world.aborted.is_set()

    def world(self) -> memberships.WorldSnapshot | None:
        """The last join of NeMo's world, if any."""
        with self._lock:
            world = self._world
            return world.snapshot() if world is not None else None

    def joined(self, session: str | None) -> nemo_collective.NemoJoinRequest:
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

    def stages(self, session: str) -> reshard_stages.StageMembership:
        """The stage communicators this rank joined beside ``session``'s NeMo world (a refit checks
        they are joined when it runs); :class:`NotJoined` when it holds none for it."""
        self.joined(session)
        with self._lock:
            world = self._world
            stages = world.stages if world is not None and world.request.session == session else None
        if stages is None:
            raise NotJoined(
                f"this rank has not joined the stage communicators of session {session!r}: call "
                "POST /v1/refit/nemo/reshard/join first"
            )
        return stages

    def leave(self, session: str) -> memberships.WorldSnapshot:
        """Drop this rank's membership of ``session``'s world (``POST /v1/refit/nemo/leave``): stop a
        join in progress, fail a refit running over it (the engine stays stale, as after any failed
        refit) and close the communicator; an engine with nothing running serves on. Idempotent: a
        session this rank does not hold answers ``left`` and changes nothing."""
        with self._lock:
            world, attempt = self._world, self._attempt
            if world is None or world.request.session != session:
                return memberships.WorldSnapshot(session, "left", self.rank)
            world.phase = "left"
        world.aborted.set()
        if attempt is not None and attempt.source.runs_over(session):
            attempt.abort(f"aborted: this rank left RefitSession {session}'s world", timed_out=False)
        parked = self.target.take_parked(world.holds)
        if parked is not None:
            parked.discard()
        if world.receiver is not None:
            world.receiver.close()
        world.leave_stages()
        log.info("left NeMo's world for session %s", session)
        return world.snapshot()

    def abort(self, reason: str) -> phases.Snapshot:
        """End the running attempt now (as the watchdog would), and close a parked transfer group
        (and a join of NeMo's world still in progress)."""
        with self._lock:
            attempt = self._attempt
            world = self._world
        if world is not None:
            world.aborted.set()
            world.leave_stages(f"aborted: {reason}")  # NeMo's world goes with the parked group below
        if attempt is not None:
            attempt.abort(f"aborted: {reason}", timed_out=False)
        self.target.discard_parked()
        return self.snapshot()

    def close(self) -> None:
        """Engine shutdown: close the parked transfer group, if any, and stop a join in progress (a
        running attempt is left to its watchdog)."""
        with self._lock:
            world = self._world
        if world is not None:
            world.aborted.set()
            world.leave_stages("the engine is stopping")
        self.target.discard_parked()


def backend_name(backend: object) -> str:
    """What the reasons call a backend: ``transformers`` for ``TransformersBackend``."""
    name = type(backend).__name__
    return name.removesuffix("Backend").lower() or name
