"""One refit attempt: its thread, its watchdog and its phases, whatever its source.

Made and started by the refit controller (:mod:`megafleet_engine.refit_attempts.controller`) in the
agent's route, with its modes (:mod:`~megafleet_engine.refit_attempts.modes`: what it does with the
sequences in flight, whether it stages) and the weight target they call for; everything after
:meth:`Attempt.start` runs on the attempt's own thread (the HTTP server never waits on a
collective), except :meth:`Attempt.abort`, which the watchdog's thread, the agent's abort route or a
leave may call from any thread. The phases, in order:

1. the source's :meth:`~megafleet_engine.refit_attempts.sources.Source.run`: hold the engine
   (``suspending`` for drain or abort, ``pausing`` at a step boundary for keep; a staged attempt
   leaves it serving), join or reuse the trainer's world (``joining``), receive and write
   (``receiving``, or ``staging`` into the staging copy) or load (``applying``), and verify no tensor
   was rebound;
2. commit (:mod:`~megafleet_engine.refit_attempts.engine_hold`): a staged attempt whose commit is
   the trainer's or the operator's reports ``staged`` and waits for it
   (:meth:`Attempt.wait_for_commit`; the trainer's through its source, the operator's through the
   :mod:`~megafleet_engine.refit_attempts.commit_gate`) until its deadline plus its grace, else it
   fails with the staged copy discarded; a staged attempt holds the engine now (``switching``);
   settle (on a shard of several ranks, agree that every rank
   holds the new version); claim success; serve the version: a kept engine switches at its step
   boundary (``switching``), a drained or aborted one resumes (``resuming``), a staged copy is copied
   into the live weights first; park the source's group for the next refit, report ``succeeded`` and
   only then tell the trainer;
3. or fail: tell the trainer, then abort (the engine released as its weights allow, the group torn
   down, ``failed``); the watchdog expires the attempt the same way at its deadline.

docs/refit-protocol.md ("An attempt on the engine") tells each phase.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from megafleet_engine.refit_attempts import commit_gate, engine_hold, phases, watchdog
from megafleet_protocol.refit import deadlines, errors

if TYPE_CHECKING:
    from megafleet_engine import metrics as metrics_module
    from megafleet_engine.refit_attempts import modes as modes_module
    from megafleet_engine.refit_attempts import sources, weight_target

__all__ = ["Attempt"]

log = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K", bound="weight_target.Kept")


class Attempt:
    """One refit attempt from ``source`` into ``target`` (implements the sources'
    :class:`~megafleet_engine.refit_attempts.sources.Run`).

    Args:
        source: the request's source (made by the controller before it admitted the request:
            making it checks that the request fits this rank).
        target: the weights it writes: the engine's live weights, or its staging copy (``modes``).
        loop: the agent's event loop, where the engine's calls run.
        modes: what it does with the sequences in flight and whether it stages.
        parked: what the last successful refit kept; the attempt's thread reuses it or discards it.
        metrics: where the attempt's duration and stall are recorded, if anywhere.
    """

    def __init__(
        self,
        source: sources.Source,
        target: weight_target.WeightTarget,
        loop: asyncio.AbstractEventLoop,
        modes: modes_module.Modes,
        *,
        parked: weight_target.Kept | None = None,
        metrics: metrics_module.Metrics | None = None,
    ) -> None:
        from megafleet_protocol.refit import communicator  # torch loads here, not at agent import

        self.request = request = source.request
        self.source = source
        self.target = target
        self.engine = target.engine
        self.loop = loop
        self.modes = modes
        self.parked = parked  # taken (reused or closed) by the attempt's thread
        self.metrics = metrics
        self.deadline = communicator.Deadline(request.timeout_seconds)
        self.record = source.record()
        self.record.set_reports(in_flight=modes.in_flight, staging=modes.staging)
        if modes.staged:  # the engine serves while the source receives
            self.record.alias({"suspending": "staging", "receiving": "staging", "applying": "staging"})
            self.record.enter("staging")
        elif modes.keep:
            self.record.enter("pausing")
        if request.commit != "local":
            self.record.set_reports(commit=modes.commit)
        self.hold = engine_hold.EngineHold(target, loop, modes, self.record, self.deadline)
        self.gate = commit_gate.CommitGate()  # the operator's commit (POST /v1/refit/commit)
        self._commit_waited = False  # the attempt's thread went through wait_for_commit
        self.aborted = threading.Event()  # the communicator's abort flag, also before it exists
        self._watchdog = watchdog.Watchdog(request.timeout_seconds, self._expire)
        self._thread = threading.Thread(target=self._run, name=f"megafleet-refit-{request.version}", daemon=True)

    def start(self) -> None:
        log.info("refit to weight version %d (%s) started", self.request.version, self.source.describe())
        self._watchdog.start()
        self._thread.start()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def abort(self, reason: str, *, timed_out: bool) -> None:
        """Fail the attempt now: release the engine as far as its weights allow (a live engine that
        holds part of the version goes stale) and tear its group down (any thread)."""
        if not self.record.finish(error=reason, timed_out=timed_out):
            return
        self.gate.shut(reason)
        self.hold.release(reason)
        self.aborted.set()
        self._settle(ok=False)  # a following rank tells its first rank it does not hold the version
        self.source.abort(reason)
        self._observe(succeeded=False)
        log.error("refit to weight version %d failed: %s", self.request.version, reason)

    # -- the attempt's thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.modes.unavailable is not None:  # nothing touched: the engine serves on
                self._refuse(self.modes.unavailable)
                return
            self.source.run(self)
            self._commit()
        except Exception as error:
            self.source.report(str(error) or type(error).__name__)
            self._fail(error)
        finally:
            self.hold.cancel()  # a hold still starting (the join failed first): the engine stays held
            if self.modes.staged and self.record.snapshot().phase == "failed":
                self.engine.backend.discard_staged()
            self._watchdog.stop()
            self.drop_parked()  # failed before it got to the join
            self.source.close()

    # -- what the source runs through (sources.Run) ---------------------------------------------

    def start_suspend(self) -> concurrent.futures.Future[None]:
        """Start holding the engine on the agent's loop (suspend, pause, or nothing when staged);
        it runs while the attempt joins the trainer's world, and nothing is received or written
        before it ends."""
        return self.hold.start()

    def suspend(self) -> None:
        self.wait_suspended(self.hold.start())

    def wait_suspended(self, suspended: concurrent.futures.Future[None]) -> None:
        """Wait until the hold started by :meth:`start_suspend` is in place, until the deadline."""
        self.hold.wait(suspended)

    def take_parked(self, key: tuple[object, ...], kind: type[K]) -> K | None:
        parked, self.parked = self.parked, None
        if parked is None:
            return None
        if isinstance(parked, kind) and parked.key == key:
            return parked
        parked.discard()
        return None

    def drop_parked(self) -> None:
        parked, self.parked = self.parked, None
        if parked is not None:
            parked.discard()

    def apply(self, write: Callable[[], int]) -> int:
        """Run ``write`` unless the attempt ended meanwhile: on the backend thread for the live
        weights (suspended, or parked at a step boundary), on this thread for the staging copy
        (the engine serves meanwhile)."""

        def guarded() -> int:
            if self.record.finished:
                raise errors.RefitAborted("the refit ended; no further weights are written")
            return write()

        if self.target.staged:
            return guarded()
        self.target.mark_dirty(True)
        return self._on_loop(self.engine.run_exclusive(guarded), "writing weights")

    def wait_for_commit(self, decide: Callable[[deadlines.Deadline], None] | None = None) -> None:
        """A staged attempt whose commit is the trainer's or the operator's: report ``staged`` and wait
        for the commit until the deadline plus ``commit_grace_seconds`` (``decide``: the source waits
        for the trainer's; else the operator's, through :attr:`gate`); once per attempt, nothing for
        any other attempt. Raises :class:`~megafleet_protocol.refit.errors.CommitExpired` past that,
        :class:`RefitAborted` on an abort or the trainer's no-go."""
        if not self.modes.waits_for_commit or self._commit_waited:
            return
        self._commit_waited = True
        grace = self.request.commit_grace_seconds
        self.record.enter("staged")
        self._watchdog.extend(grace)
        waiting = deadlines.Deadline(max(self.deadline.remaining, 0.0) + grace)
        if decide is not None:
            decide(waiting)
        else:
            self.gate.wait(waiting.remaining, self._expired_message())
        self.record.set_reports(commit=dataclasses.replace(self.modes.commit, committed=True))

    def commit(self) -> phases.Snapshot:
        """The operator's commit (``POST /v1/refit/commit``, any thread): open the gate of an attempt
        staged for it. Idempotent: an attempt that serves the version, or whose gate is open, answers
        its status; :class:`~megafleet_engine.refit_attempts.controller.NotStaged` otherwise."""
        from megafleet_engine.refit_attempts import controller

        snapshot = self.record.snapshot()
        if snapshot.phase == "succeeded" or (self.gate.opened and snapshot.phase != "failed"):
            return snapshot
        if self.modes.commit.effective != "operator":
            raise controller.NotStaged(
                f"the refit to weight version {snapshot.version} is not the operator's to commit "
                f"(commit {self.modes.commit.effective}; it is {snapshot.phase})"
            )
        if snapshot.phase != "staged" or not self.gate.open():
            detail = f": {snapshot.error}" if snapshot.error else ""
            raise controller.NotStaged(f"the refit to weight version {snapshot.version} is {snapshot.phase}{detail}")
        return self.record.snapshot()

    # -- settle, commit, fail ---------------------------------------------------------------------

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
        self.wait_for_commit()
        pause = self.hold.commit(lambda: self._settle(ok=True))
        self.target.mark_dirty(False)
        self.record.set_reports(pause=pause)
        self.source.keep(self.target)  # before the success shows: the next refit's call finds it parked
        self.record.finish(error=None)
        self.source.report(None)  # the trainer learns it once this version serves
        self._observe(succeeded=True, stall_seconds=pause.stall_seconds)
        snapshot = self.record.snapshot()
        log.info(
            "refit to weight version %d succeeded in %.3f s (%s; stalled %.3f s)",
            self.request.version,
            snapshot.duration_seconds or 0.0,
            ", ".join(f"{name} {seconds:.3f} s" for name, seconds in snapshot.phases),
            pause.stall_seconds,
        )

    def _refuse(self, reason: str) -> None:
        """Fail before touching the engine (it serves on as it was)."""
        if self.record.finish(error=reason):
            self.source.report(reason)
            self._observe(succeeded=False)
            log.error("refit to weight version %d refused: %s", self.request.version, reason)

    def _fail(self, error: Exception) -> None:
        if isinstance(error, errors.CommitExpired):
            self.record.set_reports(commit=dataclasses.replace(self.modes.commit, expired=True))
        message = str(error) or type(error).__name__
        if not isinstance(error, errors.RefitError):
            log.exception("refit to weight version %d raised", self.request.version)
            message = f"{type(error).__name__}: {message}"
        self.abort(message, timed_out=isinstance(error, errors.RefitTimeout))

    def _expired_message(self) -> str:
        request = self.request
        return (
            f"CommitExpired: no {self.modes.commit.effective} commit came within timeoutSeconds="
            f"{request.timeout_seconds:g} plus commitGraceSeconds={request.commit_grace_seconds:g}; the staged "
            f"copy is discarded and weight version {self.engine.weight_version} serves on"
        )

    def _expire(self) -> None:
        snapshot = self.record.snapshot()
        if snapshot.phase == "staged" and self._commit_waited:
            self.record.set_reports(commit=dataclasses.replace(self.modes.commit, expired=True))
            self.abort(self._expired_message(), timed_out=True)
            return
        self.abort(
            f"the refit did not finish within timeoutSeconds={self.request.timeout_seconds:g} "
            f"(it was {snapshot.phase}); aborted by the watchdog",
            timed_out=True,
        )

    def _on_loop(self, coroutine: Coroutine[Any, Any, T], what: str) -> T:
        """Run an engine coroutine on the agent's event loop and wait for it until the deadline."""
        return engine_hold.on_loop(self.loop, coroutine, self.deadline, what)

    def _observe(self, *, succeeded: bool, stall_seconds: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.observe_refit(self.record.elapsed, succeeded=succeeded)
            if stall_seconds is not None:
                self.metrics.observe_refit_stall(stall_seconds)
