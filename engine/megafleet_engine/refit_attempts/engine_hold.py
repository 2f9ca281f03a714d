"""How one refit attempt holds its engine and lets it go: suspended (drain, abort), paused between two
steps (keep) or left serving (staged, until the switch); then switched or resumed to the new version
when the weights are complete, or released on failure as far as the weights allow.

Used by the refit attempt (:mod:`megafleet_engine.refit_attempts.attempt`) only: :meth:`EngineHold.start`,
:meth:`EngineHold.wait` and :meth:`EngineHold.commit` on the attempt's thread (sources reach the
first two through the attempt's ``Run``), :meth:`EngineHold.release` from any thread when the attempt
fails (the watchdog, the abort route). A hold never starts after its release, so no pause or suspend
outlives a failed attempt.

On failure, by what the attempt did to the live weights:

* partly written (dirty): the engine goes ``stale``; a paused engine ends its kept sequences with
  ``refit to vN failed after its weights were written: ...`` (and those queued meanwhile);
* staged and nothing written live: the engine serves on with the old version (a pause is released,
  a finished suspend resumed);
* in place and nothing written: ``stale`` as before; a paused engine's kept sequences go on with the
  old version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from megafleet_engine.refit_attempts import phases
from megafleet_protocol import vocabulary
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine import engine as engine_module
    from megafleet_engine.refit_attempts import modes as modes_module
    from megafleet_engine.refit_attempts import weight_target
    from megafleet_protocol.refit import communicator

__all__ = ["EngineHold", "on_loop"]

T = TypeVar("T")
_State = Literal["serving", "suspending", "suspended", "pausing", "paused", "switched"]


class EngineHold:
    """One attempt's hold on ``target``'s engine.

    Args:
        target: the weights the attempt writes (live or staged); its engine is held.
        loop: the agent's event loop, where the engine's calls run.
        modes: the attempt's modes (:mod:`~megafleet_engine.refit_attempts.modes`).
        record: the attempt's record (timings, in-flight report).
        deadline: when the attempt must be over.
    """

    def __init__(
        self,
        target: weight_target.WeightTarget,
        loop: asyncio.AbstractEventLoop,
        modes: modes_module.Modes,
        record: phases.Progress,
        deadline: communicator.Deadline,
    ) -> None:
        self.target = target
        self.engine: engine_module.Engine = target.engine
        self.loop = loop
        self.modes = modes
        self.record = record
        self.deadline = deadline
        self._lock = threading.Lock()
        self._state: _State = "serving"
        self._released = False
        self._future: concurrent.futures.Future[None] | None = None
        self._closed_at = 0.0  # the gate closed (suspend started)
        self._quiet_at = 0.0  # nothing generated any more (the suspend ended)
        self._suspended: engine_module.Suspended | None = None

    # -- the attempt's thread --------------------------------------------------------------------

    def start(self) -> concurrent.futures.Future[None]:
        """Get the engine ready for writes into the target: suspend it (drain, abort), pause it
        (keep), or nothing (staged: it serves on until the switch). Returns at once."""
        if self.modes.staged:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        return self._hold()

    def wait(self, future: concurrent.futures.Future[None]) -> None:
        """Wait until what :meth:`start` began ended, until the deadline."""
        what = "pausing the engine" if self.modes.keep else "suspending the engine"
        try:
            future.result(timeout=self.deadline.left(what).total_seconds())
        except TimeoutError as error:  # the engine's own timeout, or this wait's (the same class)
            if not future.done():
                raise errors.RefitTimeout(f"the refit's deadline passed while {what}") from None
            raise errors.RefitTimeout(f"{what} ({self.modes.in_flight.effective}) did not finish: {error}") from None

    def commit(self, settle: Callable[[], None]) -> phases.Pause:
        """The weights are complete: hold a staged attempt's engine now, ``settle()`` (the shard's
        ranks agree), claim success and serve the new version. Returns the pause it caused."""
        if self.modes.staged:
            self.record.enter("staged")
            self.wait(self._hold())
            self.record.enter("switching")
        settle()
        phase: vocabulary.AttemptPhase = "switching" if self.modes.keep or self.modes.staged else "resuming"
        if not self.record.begin_commit(phase):
            raise errors.RefitAborted("the refit ended before it could switch the engine")
        try:
            return self._serve_new_version()
        except Exception:
            self.record.cancel_commit()  # the switch failed: the attempt fails after all
            raise

    def cancel(self) -> None:
        """The attempt's thread ends: a hold still starting is not waited for any more."""
        future = self._future
        if future is not None and not future.done():
            future.cancel()

    # -- any thread ------------------------------------------------------------------------------

    def release(self, reason: str) -> None:
        """The attempt failed: let the engine go as far as its weights allow (once)."""
        with self._lock:
            if self._released:
                return
            self._released = True
            state = self._state
        engine = self.engine
        paused = state in ("pausing", "paused")
        if state == "switched":
            return
        if self.target.dirty:
            engine.mark("stale", reason)
            if paused:
                version = self.record.snapshot().version
                engine.unpause(error=f"refit to v{version} failed after its weights were written: {reason}")
            return
        if self.modes.staged and state != "suspending":
            if paused:
                engine.unpause()
            elif state == "suspended" and engine.weight_version is not None:
                engine.resume()  # the old version again: nothing of the new one went live
            elif state == "suspended":
                engine.mark("stale", reason)
            return
        engine.mark("stale", reason)
        if paused:
            engine.unpause()

    # -- inside ------------------------------------------------------------------------------------

    def _hold(self) -> concurrent.futures.Future[None]:
        if self.modes.keep:
            return self._begin("pausing", self._pause())
        return self._begin("suspending", self._suspend())

    def _begin(self, state: _State, coroutine: Coroutine[Any, Any, None]) -> concurrent.futures.Future[None]:
        with self._lock:
            if self._released:
                coroutine.close()
                raise errors.RefitAborted("the refit ended before it held the engine")
            self._state = state
            try:
                self._future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
            except RuntimeError:  # the loop is closed: the server is stopping
                coroutine.close()
                raise errors.RefitAborted("the agent is stopping; the engine was not held") from None
            return self._future

    async def _suspend(self) -> None:
        remaining = self.deadline.left("suspending the engine").total_seconds()
        with self.record.timed("suspend"):
            self._closed_at = time.monotonic()
            # hold: requests arriving meanwhile wait for the new version instead of a 503
            self._suspended = await self.engine.suspend(self.modes.suspend_mode, timeout_seconds=remaining, hold=True)
            self._quiet_at = time.monotonic()
        self._entered("suspended")

    async def _pause(self) -> None:
        remaining = self.deadline.left("pausing the engine").total_seconds()
        with self.record.timed("pause"):
            await self.engine.pause(timeout_seconds=remaining)
        self._entered("paused")

    def _entered(self, state: _State) -> None:
        with self._lock:
            if not self._released:
                self._state = state

    def _serve_new_version(self) -> phases.Pause:
        version = self.record.snapshot().version
        assert version is not None
        modes, engine = self.modes, self.engine
        with self.record.timed("switch" if modes.keep or modes.staged else "resume"):
            if modes.staged:
                self.target.mark_dirty(True)  # the copy goes live: a failure leaves two versions
            if modes.keep:
                kv = modes.in_flight.kv_cache_mode
                paused = self._on_loop(engine.switch(version, kv, staged=modes.staged), "switching the engine")
                self._switched()
                self._report(kept=paused.kept, recomputed_tokens=paused.recomputed_tokens)
                return phases.Pause(
                    paused.stall_seconds, 0.0, paused.switch_seconds, recompute_seconds=paused.recompute_seconds
                )
            copied = 0.0
            if modes.staged:
                started = time.monotonic()
                self._on_loop(engine.run_exclusive(engine.backend.commit_staged), "copying the staged weights")
                copied = time.monotonic() - started
            engine.resume(weight_version=version)
            self._switched()
        now = time.monotonic()
        self._report(suspended=self._suspended)
        return phases.Pause(now - self._quiet_at, now - self._closed_at, copied)

    def _switched(self) -> None:
        with self._lock:
            self._state = "switched"

    def _report(
        self, *, kept: int = 0, recomputed_tokens: int = 0, suspended: engine_module.Suspended | None = None
    ) -> None:
        report = dataclasses.replace(self.modes.in_flight, kept=kept, recomputed_tokens=recomputed_tokens)
        if suspended is not None:
            report = dataclasses.replace(
                report,
                drained=suspended.drained,
                aborted=suspended.aborted,
                aborted_tokens=suspended.aborted_tokens,
            )
        self.record.set_reports(in_flight=report)

    def _on_loop(self, coroutine: Coroutine[Any, Any, T], what: str) -> T:
        return on_loop(self.loop, coroutine, self.deadline, what)


def on_loop(
    loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, T], deadline: communicator.Deadline, what: str
) -> T:
    """Run an engine coroutine on the agent's event ``loop`` and wait for it until ``deadline``."""
    try:
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
    except RuntimeError:  # the loop is closed: the server is stopping
        coroutine.close()
        raise errors.RefitAborted(f"the agent is stopping; {what} did not run") from None
    try:
        return future.result(timeout=deadline.left(what).total_seconds())
    except concurrent.futures.TimeoutError:
        if future.done():  # the coroutine's own TimeoutError (a drain that did not finish)
            raise
        future.cancel()
        raise errors.RefitTimeout(f"the refit's deadline passed while {what}") from None
