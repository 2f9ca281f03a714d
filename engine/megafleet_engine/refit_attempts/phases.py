"""The phases of one refit attempt as its record keeps them: phase, per-phase timings, counters, outcome.

Written by the attempt's thread and by its watchdog (:mod:`megafleet_engine.refit_attempts.attempt`),
by the attempt's source (:mod:`megafleet_engine.refit_attempts.sources`) and by the receiver
(:func:`megafleet_protocol.refit.receiver.receive`, through its ``Record``), read by the agent's
``GET /v1/refit/status``; every access holds one lock. The outcome is decided once:
:meth:`Progress.finish` returns ``True`` only to the first caller, and :meth:`Progress.begin_commit`
lets the attempt claim success before it resumes the engine, after which the watchdog can no longer
fail it (so an engine is never resumed by an attempt that was already reported failed). A switch that
fails after that claim (:meth:`Progress.cancel_commit`) gives the failure back its say.

Besides its phase and timings, an attempt reports what it did with the sequences in flight
(:class:`InFlight`), where it received its weights (:class:`Staging`), how long it kept the engine
from generating (:class:`Pause`) and who let its version go live (:class:`Commit`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import verification

__all__ = ["TIMED_PHASES", "Commit", "InFlight", "Pause", "Progress", "Snapshot", "Staging"]

TIMED_PHASES = ("suspend", "pause", "join", "receive", "apply", "switch", "resume")
"""Names of the timings, in order (the Refit status's ``phases``). Buckets are pipelined (bucket k is
written while bucket k+1 travels): ``receive`` sums the time the attempt waited for bucket data and
``apply`` the time it waited for writes, so together they are the wall time of the transfer, not the
sum of both costs. ``pause``: waiting for the engine to park at a step boundary (keep, in place);
``switch``: from the end of the transfer to the new version serving (a staged attempt's pause or
suspend, settle and copy, or a kept one's switch)."""


@dataclasses.dataclass(frozen=True)
class InFlight:
    """What an attempt did with the sequences in flight (``requested`` and ``effective`` differ, with
    a ``reason``, when the backend cannot keep in the requested KV-cache mode: it drained)."""

    requested: vocabulary.InFlightMode
    effective: vocabulary.InFlightMode
    kv_cache_mode: vocabulary.KvCacheMode
    reason: str | None = None
    kept: int = 0
    drained: int = 0
    aborted: int = 0
    aborted_tokens: int = 0
    recomputed_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Staging:
    """Where an attempt received its weights: the staging copy (``staged``) or the live weights."""

    requested: vocabulary.StagingMode
    effective: vocabulary.StagingEffective
    reason: str | None = None
    bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Commit:
    """Who lets the attempt's version go live (``effective`` is ``local`` when it received in place,
    with the ``reason``), whether the commit came, and whether the wait for it expired."""

    requested: vocabulary.CommitMode
    effective: vocabulary.CommitMode
    reason: str | None = None
    committed: bool = False
    expired: bool = False


@dataclasses.dataclass(frozen=True)
class Pause:
    """How long a successful attempt kept the engine from generating, in seconds: ``stall`` from its
    last step before the switch to its first after (a drain's wait excluded), ``gate_closed`` while
    new requests waited at the gate (0 when kept), and the ``switch`` copy and ``recompute`` in it."""

    stall_seconds: float
    gate_closed_seconds: float = 0.0
    switch_seconds: float = 0.0
    recompute_seconds: float = 0.0


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
    in_flight: InFlight | None = None
    staging: Staging | None = None
    pause: Pause | None = None  # once the engine serves the version
    commit: Commit | None = None


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
        self._aliases: dict[vocabulary.AttemptPhase, vocabulary.AttemptPhase] = {}

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._state.phase in ("succeeded", "failed")

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def enter(self, phase: vocabulary.AttemptPhase) -> None:
        """Move to ``phase`` (as :meth:`alias` names it) unless the outcome is decided."""
        with self._lock:
            if self._state.phase not in ("succeeded", "failed"):
                self._state = dataclasses.replace(self._state, phase=self._aliases.get(phase, phase))

    def alias(self, aliases: dict[vocabulary.AttemptPhase, vocabulary.AttemptPhase]) -> None:
        """Report the phases a source enters under other names from now on (a staged attempt's
        ``receiving`` and ``applying`` are ``staging``: the engine serves meanwhile)."""
        with self._lock:
            self._aliases = dict(aliases)

    def set_reports(
        self,
        *,
        in_flight: InFlight | None = None,
        staging: Staging | None = None,
        pause: Pause | None = None,
        commit: Commit | None = None,
    ) -> None:
        """Replace the reports given (the others stay)."""
        with self._lock:
            state = self._state
            self._state = dataclasses.replace(
                state,
                in_flight=in_flight or state.in_flight,
                staging=staging or state.staging,
                pause=pause or state.pause,
                commit=commit or state.commit,
            )

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

    def begin_commit(self, phase: vocabulary.AttemptPhase = "resuming") -> bool:
        """Claim success before resuming or switching (``phase``); ``False`` when the attempt already
        failed (aborted)."""
        with self._lock:
            if self._state.phase in ("succeeded", "failed"):
                return False
            self._committing = True
            self._state = dataclasses.replace(self._state, phase=phase)
            return True

    def cancel_commit(self) -> None:
        """The switch failed after :meth:`begin_commit`: the attempt may fail after all."""
        with self._lock:
            self._committing = False

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
