"""The engine's pause point: where a refit that keeps the running sequences parks the backend thread,
runs its weight writes there, and releases it with a switch of the weight version or without one.

Used by the engine's scheduler (:class:`megafleet_engine.engine.Engine`) only. Any thread asks for a
pause (:meth:`PausePoint.request`), hands the parked thread work (:meth:`PausePoint.submit`, what
``Engine.run_exclusive`` does while a pause is asked for or holds) and releases it
(:meth:`PausePoint.release`, :meth:`PausePoint.withdraw`); the backend thread, at every step boundary
of a batch whose backend keeps sequences and between batches, reads :attr:`PausePoint.requested` (one
attribute read, no lock) and, when it is set, stops in :meth:`PausePoint.park` until released.

Invariants: the calls queued while a pause holds run on the parked thread, in order, before its
release is looked at; a release reaches the thread exactly once; a switch is handed to the backend
once (:class:`~megafleet_engine.backends.base.Switch`) and its outcome (:class:`Paused`) is recorded
once, by the backend's ``done`` or, failing that, when the backend takes its next step or ends the
batch (:meth:`PausePoint.settle_switch`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Callable

from megafleet_engine.backends import base
from megafleet_protocol import vocabulary

__all__ = ["Call", "PauseError", "PausePoint", "Paused", "Release", "SwitchOrder"]


class PauseError(RuntimeError):
    """A pause was taken back before the thread parked, or a switch found no parked thread."""


@dataclasses.dataclass
class Call:
    """Work for the backend thread other than generation (weight writes, cache rebuilds)."""

    fn: Callable[[], object]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None

    def run(self) -> None:
        """Run ``fn`` here; its result or error goes to whoever waits for :attr:`done`."""
        try:
            self.result = self.fn()
        except BaseException as error:  # handed to the awaiting coroutine
            self.error = error
        finally:
            self.done.set()


@dataclasses.dataclass(frozen=True)
class Paused:
    """One pause that ended in a switch, as the refit reports it (seconds)."""

    stall_seconds: float
    """From the moment the backend thread parked to the moment it went on with the new weights (the
    switch applied: the staged copy committed, the KV recomputed)."""
    switch_seconds: float = 0.0
    """Copying the staging copy into the live tensors (0 in place)."""
    recompute_seconds: float = 0.0
    """Recomputing the kept sequences' KV with the new weights (``recompute`` only)."""
    kept: int = 0
    """Sequences that were running when the thread parked and went on after the switch."""
    recomputed_tokens: int = 0
    """Tokens whose KV was recomputed."""
    between_batches: bool = False
    """The thread parked between two batches (nothing was kept)."""


@dataclasses.dataclass(eq=False)
class SwitchOrder:
    """A switch to ``version`` the parked thread carries out; :attr:`applied` is set once its
    outcome (:attr:`paused`) is known."""

    version: int
    kv_cache_mode: vocabulary.KvCacheMode
    staged: bool
    switch_seconds: float = 0.0
    applied: threading.Event = dataclasses.field(default_factory=threading.Event)
    paused: Paused | None = None


@dataclasses.dataclass(frozen=True)
class Release:
    """How a parked thread goes on: with ``switch``, or without one; ``error`` (no switch): the
    weights were partly written, so what was kept ends with it."""

    switch: SwitchOrder | None = None
    error: str | None = None


@dataclasses.dataclass
class _Handover:
    """A switch handed to the backend whose outcome is not in yet (backend thread only)."""

    order: SwitchOrder
    parked_at: float
    kept: int
    between_batches: bool


class PausePoint:
    """The pause of one engine's backend thread (at most one at a time).

    ``kept_sequences`` and ``recomputed_tokens`` count, over the engine's life, the sequences carried
    across switches and the tokens whose KV was recomputed (the metrics read them at scrape time).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.requested = False
        """A pause is asked for or holds (read by the backend thread at every step boundary, unlocked)."""
        self._parked = False
        self._parked_at = 0.0
        self._calls: collections.deque[Call] = collections.deque()
        self._release: Release | None = None
        self._handover: _Handover | None = None  # backend thread only
        self.kept_sequences = 0
        self.recomputed_tokens = 0

    @property
    def parked(self) -> bool:
        with self._lock:
            return self._parked

    # -- the engine's API (its event loop) -----------------------------------------------------------

    async def pause(self, timeout_seconds: float, *, wake: Callable[[], None]) -> None:
        """Ask for a pause, ``wake`` an idle backend thread, and return once it parked."""
        self.request()
        wake()
        if not await asyncio.to_thread(self.wait_parked, timeout_seconds):
            if self.requested:
                raise TimeoutError(f"the engine did not reach a step boundary within {timeout_seconds:g} s")
            raise PauseError("the pause was taken back before the engine reached a step boundary")

    async def switch(self, order: SwitchOrder, commit: Callable[[], object] | None, timeout_seconds: float) -> Paused:
        """Run ``commit`` (if any) on the parked thread, then release it with ``order``; return once
        the backend applied it."""
        if commit is not None:
            started = time.monotonic()
            call = Call(commit)
            if not self.parked or not self.submit(call):
                raise PauseError("switching weights needs a paused engine")
            await asyncio.to_thread(call.done.wait)
            if call.error is not None:
                raise call.error
            order.switch_seconds = time.monotonic() - started
        if not self.release(Release(switch=order)):
            raise PauseError("switching weights needs a paused engine")
        if not await asyncio.to_thread(order.applied.wait, timeout_seconds):
            raise TimeoutError(f"the backend did not apply the switch to {order.version} in {timeout_seconds:g} s")
        assert order.paused is not None
        return order.paused

    # -- any thread ------------------------------------------------------------------------------

    def request(self) -> None:
        """Ask the backend thread to park at its next step boundary (idempotent)."""
        with self._lock:
            self.requested = True

    def wait_parked(self, timeout_seconds: float) -> bool:
        """Block until the thread parked (``True``), the request was withdrawn or the time ran out."""
        deadline = time.monotonic() + timeout_seconds
        with self._lock:
            while self.requested and not self._parked:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return self._parked

    def submit(self, call: Call) -> bool:
        """Queue ``call`` for the parked thread; ``False`` when no pause is asked for (the caller
        queues it as usual)."""
        with self._lock:
            if not self.requested:
                return False
            self._calls.append(call)
            self._changed.notify_all()
            return True

    def release(self, release: Release) -> bool:
        """Let the parked thread go on as ``release`` says; ``False`` when it is not parked (or was
        released already)."""
        with self._lock:
            if not self._parked or self._release is not None:
                return False
            self._release = release
            self._changed.notify_all()
            return True

    def withdraw(self) -> list[Call]:
        """Take back a request the thread has not parked for yet (a parked thread is left to
        :meth:`release`); returns the calls queued meanwhile, for the caller to queue as usual."""
        with self._lock:
            if self._parked or not self.requested:
                return []
            self.requested = False
            calls = list(self._calls)
            self._calls.clear()
            self._changed.notify_all()
            return calls

    # -- the backend thread ----------------------------------------------------------------------

    def park(self, kept: int, *, between_batches: bool) -> Release:
        """Stop here until released, running the queued calls in order meanwhile; ``kept``: the
        sequences in the running batch. Returns the release, with its switch (if any) handed over."""
        with self._lock:
            self._parked = True
            self._parked_at = time.monotonic()
            self._changed.notify_all()
        while True:
            with self._lock:
                while not self._calls and self._release is None:
                    self._changed.wait()
                call = self._calls.popleft() if self._calls else None
                if call is None:
                    release, self._release = self._release, None
                    assert release is not None
                    self._parked = False
                    self.requested = False
                    parked_at = self._parked_at
                    self._changed.notify_all()
                    break
            call.run()
        if release.switch is not None:
            self._handover = _Handover(release.switch, parked_at, kept, between_batches)
        return release

    def backend_switch(self, order: SwitchOrder) -> base.Switch:
        """The :class:`~megafleet_engine.backends.base.Switch` the backend gets for ``order``; its
        ``done`` records the outcome."""
        return base.Switch(order.version, order.kv_cache_mode, order.staged, done=self._switched)

    def settle_switch(self) -> None:
        """The backend took its next step (or ended the batch) without reporting the switch it was
        handed: it kept nothing it had to recompute (backend thread; cheap when nothing is pending)."""
        if self._handover is not None:
            self._switched(base.Switched())

    def _switched(self, outcome: base.Switched) -> None:
        handover, self._handover = self._handover, None
        if handover is None:
            return  # reported twice: the first report counts
        order = handover.order
        self.kept_sequences += handover.kept
        self.recomputed_tokens += outcome.recomputed_tokens
        order.paused = Paused(
            stall_seconds=time.monotonic() - handover.parked_at,
            switch_seconds=order.switch_seconds,
            recompute_seconds=outcome.recompute_seconds,
            kept=handover.kept,
            recomputed_tokens=outcome.recomputed_tokens,
            between_batches=handover.between_batches,
        )
        order.applied.set()
