"""One refit attempt: its thread, its watchdog and its phases, whatever its source.

Made and started by the refit controller (:mod:`megafleet_engine.refit_attempts.controller`) in the
agent's route; everything after :meth:`Attempt.start` runs on the attempt's own thread (the HTTP
server never waits on a collective), except :meth:`Attempt.abort`, which the watchdog's thread, the
agent's abort route or a leave may call from any thread. The phases, in order:

1. the source's :meth:`~megafleet_engine.refit_attempts.sources.Source.run`: suspend the engine
   (``suspending``), join or reuse the trainer's world (``joining``), receive and write in place
   (``receiving``) or load (``applying``), and verify no parameter was rebound;
2. settle: on a shard of several ranks, agree that every rank holds the new version;
3. commit (``resuming``): claim success, resume the engine with the new version, keep the source's
   group for the next refit, report ``succeeded`` and only then tell the trainer;
4. or fail: tell the trainer, then abort (the engine ``stale``, the group torn down, ``failed``);
   the watchdog expires the attempt the same way at its deadline.

docs/refit-protocol.md ("An attempt on the engine") tells each phase.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from megafleet_engine.refit_attempts import watchdog
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine import metrics as metrics_module
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
        target: the engine's live weights.
        loop: the agent's event loop, where the engine's calls run.
        parked: what the last successful refit kept; the attempt's thread reuses it or discards it.
        metrics: where the attempt's duration is recorded, if anywhere.
    """

    def __init__(
        self,
        source: sources.Source,
        target: weight_target.WeightTarget,
        loop: asyncio.AbstractEventLoop,
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
        self.parked = parked  # taken (reused or closed) by the attempt's thread
        self.metrics = metrics
        self.deadline = communicator.Deadline(request.timeout_seconds)
        self.record = source.record()
        self.aborted = threading.Event()  # the communicator's abort flag, also before it exists
        self._suspended: concurrent.futures.Future[None] | None = None  # a suspend overlapping the join
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
        """Fail the attempt now: mark the engine stale and tear its group down (any thread)."""
        if not self.record.finish(error=reason, timed_out=timed_out):
            return
        self.engine.mark("stale", reason)
        self.aborted.set()
        self._settle(ok=False)  # a following rank tells its first rank it does not hold the version
        self.source.abort(reason)
        self._observe(succeeded=False)
        log.error("refit to weight version %d failed: %s", self.request.version, reason)

    # -- the attempt's thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.source.run(self)
            self._commit()
        except Exception as error:
            self.source.report(str(error) or type(error).__name__)
            self._fail(error)
        finally:
            suspended = self._suspended
            if suspended is not None and not suspended.done():
                suspended.cancel()  # the join failed first; the engine stays closed (stale)
            self._watchdog.stop()
            self.drop_parked()  # failed before it got to the join
            self.source.close()

    # -- what the source runs through (sources.Run) ---------------------------------------------

    def start_suspend(self) -> concurrent.futures.Future[None]:
        """Start suspending the engine on the agent's loop (the suspend runs while the attempt
        joins the trainer's world; nothing is received or written before it ends)."""
        self._suspended = self._begin_suspend()
        return self._suspended

    def suspend(self) -> None:
        self.wait_suspended(self._begin_suspend())

    def _begin_suspend(self) -> concurrent.futures.Future[None]:
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

    def wait_suspended(self, suspended: concurrent.futures.Future[None]) -> None:
        """Wait until the suspend started by :meth:`start_suspend` ended, until the deadline."""
        try:
            suspended.result(timeout=self.deadline.left("suspending the engine").total_seconds())
        except TimeoutError as error:  # the drain's own timeout, or this wait's (the same class)
            if not suspended.done():
                raise errors.RefitTimeout("the refit's deadline passed while suspending") from None
            raise errors.RefitTimeout(f"suspending ({self.request.suspend_mode}) did not finish: {error}") from None

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
        """Run ``write`` on the backend thread, unless the attempt ended meanwhile."""
        self.target.mark_dirty(True)

        def guarded() -> int:
            if self.record.finished:
                raise errors.RefitAborted("the refit ended; no further weights are written")
            return write()

        return self._on_loop(self.engine.run_exclusive(guarded), "writing weights")

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
        self._settle(ok=True)
        if not self.record.begin_commit():
            raise errors.RefitAborted("the refit ended before it could resume the engine")
        with self.record.timed("resume"):
            self.engine.resume(weight_version=self.request.version)
        self.target.mark_dirty(False)
        self.source.keep(self.target)  # before the success shows: the next refit's call finds it parked
        self.record.finish(error=None)
        self.source.report(None)  # the trainer learns it once this version serves
        self._observe(succeeded=True)
        snapshot = self.record.snapshot()
        log.info(
            "refit to weight version %d succeeded in %.3f s (%s)",
            self.request.version,
            snapshot.duration_seconds or 0.0,
            ", ".join(f"{name} {seconds:.3f} s" for name, seconds in snapshot.phases),
        )

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

    def _observe(self, *, succeeded: bool) -> None:
        if self.metrics is not None:
            self.metrics.observe_refit(self.record.elapsed, succeeded=succeeded)
