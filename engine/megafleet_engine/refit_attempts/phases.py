"""The phases of one refit attempt as its record keeps them: phase, per-phase timings, counters, outcome.

Written by the attempt's thread and by its watchdog (:mod:`megafleet_engine.refit_attempts.attempt`),
by the attempt's source (:mod:`megafleet_engine.refit_attempts.sources`) and by the receiver
(:func:`megafleet_protocol.refit.receiver.receive`, through its ``Record``), read by the agent's
``GET /v1/refit/status``; every access holds one lock. The outcome is decided once:
:meth:`Progress.finish` returns ``True`` only to the first caller, and :meth:`Progress.begin_commit`
lets the attempt claim success before it resumes the engine, after which the watchdog can no longer
fail it (so an engine is never resumed by an attempt that was already reported failed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import verification

__all__ = ["TIMED_PHASES", "Progress", "Snapshot"]

TIMED_PHASES = ("suspend", "join", "receive", "apply", "resume")
"""Names of the timings, in order (the Refit status's ``phases``). Buckets are pipelined (bucket k is
written while bucket k+1 travels): ``receive`` sums the time the attempt waited for bucket data and
``apply`` the time it waited for writes, so together they are the wall time of the transfer, not the
sum of both costs."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One attempt as the status route reports it (or ``idle``)."""

    phase: vocabulary.AttemptPhase = "idle"
    version: int | None = None
    source: vocabulary.RefitSource | None = None
    transport: str | None = None
    rank: int | None = None  # this process's rank in the trainer+fleet world (rendezvous only)
    world_size: int | None = None
    phases: tuple[tuple[str, float], ...] = ()  # (name, seconds) in TIMED_PHASES order, those that ran
    duration_seconds: float | None = None  # from the request to the outcome; None while running
    bytes_received: int = 0
    buckets: int = 0
    tensors_written: int = 0
    error: str | None = None
    timed_out: bool = False  # the watchdog (or a bounded wait) ended it at the deadline
    reused: bool = False  # the join kept the transfer group of the previous refit (none was built)
    verification: verification.Verification | None = None  # what verified the bytes (set by the receiver)


class Progress:
    """Thread-safe progress of one attempt."""

    def __init__(
        self,
        *,
        version: int,
        source: vocabulary.RefitSource,
        transport: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._state = Snapshot(
            phase="suspending", version=version, source=source, transport=transport, rank=rank, world_size=world_size
        )
        self._timings: dict[str, float] = {}
        self._running: dict[str, float] = {}  # timings in progress: name -> when the block started
        self._committing = False

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._state.phase in ("succeeded", "failed")

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def enter(self, phase: vocabulary.AttemptPhase) -> None:
        """Move to ``phase`` unless the outcome is decided."""
        with self._lock:
            if self._state.phase not in ("succeeded", "failed"):
                self._state = dataclasses.replace(self._state, phase=phase)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the time the block takes to timing ``name`` (reported while it runs, too). Once the
        outcome is decided the timings are final: a block still running then counts until that
        moment, as the failure report says."""
        started = time.monotonic()
        with self._lock:
            self._running[name] = started
        try:
            yield
        finally:
            with self._lock:
                if self._running.pop(name, None) is not None:
                    self._timings[name] = self._timings.get(name, 0.0) + time.monotonic() - started

    def count(self, *, bytes_received: int = 0, buckets: int = 0, tensors_written: int = 0) -> None:
        with self._lock:
            state = self._state
            self._state = dataclasses.replace(
                state,
                bytes_received=state.bytes_received + bytes_received,
                buckets=state.buckets + buckets,
                tensors_written=state.tensors_written + tensors_written,
            )

    def set_reused(self, reused: bool) -> None:
        with self._lock:
            self._state = dataclasses.replace(self._state, reused=reused)

    def verified(self, outcome: verification.Verification) -> None:
        """What verified the version's bytes (the receiver's trailers, or NeMo's digests)."""
        with self._lock:
            self._state = dataclasses.replace(self._state, verification=outcome)

    def begin_commit(self) -> bool:
        """Claim success before resuming; ``False`` when the attempt already failed (aborted)."""
        with self._lock:
            if self._state.phase in ("succeeded", "failed"):
                return False
            self._committing = True
            self._state = dataclasses.replace(self._state, phase="resuming")
            return True

    def finish(self, *, error: str | None, timed_out: bool = False) -> bool:
        """Decide the outcome (``error is None``: succeeded). Only the first call counts, and a
        failure cannot override a commit in progress; returns whether this call decided it."""
        with self._lock:
            if self._state.phase in ("succeeded", "failed") or (self._committing and error is not None):
                return False
            now = time.monotonic()
            self._timings = self._current_timings(now)
            self._running.clear()
            self._state = dataclasses.replace(
                self._state,
                phase="succeeded" if error is None else "failed",
                error=error,
                timed_out=timed_out,
                duration_seconds=now - self._started,
            )
            return True

    def snapshot(self) -> Snapshot:
        with self._lock:
            timings = self._current_timings(time.monotonic())
            phases = tuple((name, timings[name]) for name in TIMED_PHASES if name in timings)
            return dataclasses.replace(self._state, phases=phases)

    def _current_timings(self, now: float) -> dict[str, float]:
        timings = dict(self._timings)
        for name, started in self._running.items():
            timings[name] = timings.get(name, 0.0) + now - started
        return timings
