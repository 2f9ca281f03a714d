"""The weight target: one engine rank's live weights as a refit's sources see them, and what a
successful refit keeps for the next one.

Owned by the refit controller (:mod:`megafleet_engine.refit_attempts.controller`, one per engine
process) and handed to each request's source (:mod:`megafleet_engine.refit_attempts.sources`), which
writes through it on the attempt's thread; the controller reads ``dirty`` and ``parked`` for its
admission and the status. Every field is guarded by one lock of its own: the agent's routes, the
attempt's thread and a join's thread all touch it.

Invariants: a write never rebinds a parameter (:meth:`WeightTarget.verify_in_place` fails the refit
otherwise, so CUDA graphs captured on the old addresses stay valid); at most one transfer group or
joined membership is parked at a time, and a replaced one is discarded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine import engine as engine_module
    from megafleet_engine.backends import base
    from megafleet_protocol.refit import receiver

__all__ = ["Kept", "WeightTarget", "check_in_place"]


class Kept(Protocol):
    """What a successful refit keeps for the next one over the same world (a transfer group, a
    membership of NeMo's world), and the key of the requests that may reuse it."""

    @property
    def key(self) -> tuple[object, ...]: ...

    def discard(self) -> None:
        """Close it for good (any thread)."""


class WeightTarget:
    """The live weights of one engine rank and the group kept for the next refit.

    Args:
        engine: the engine whose weights are replaced.
        rank: this process's rank inside its shard (``MEGAFLEET_RANK`` + local rank); its rank in a
            trainer's world is a request's ``rank_offset`` plus this.
    """

    def __init__(self, engine: engine_module.Engine, rank: int) -> None:
        self.engine = engine
        self.rank = rank
        self._lock = threading.Lock()
        self._dirty = False
        self._parked: Kept | None = None  # kept by the last successful refit (or a join of NeMo's world)
        self._sink: receiver.Sink | None = None  # the engine's sink, nothing written (built once)
        self._pointers: dict[str, int] | None = None  # live storage addresses, as last verified

    @property
    def backend(self) -> base.Backend:
        return self.engine.backend

    @property
    def dirty(self) -> bool:
        """Weights were written by an attempt that did not complete: the engine holds no one version."""
        with self._lock:
            return self._dirty

    def mark_dirty(self, dirty: bool) -> None:
        with self._lock:
            self._dirty = dirty

    def fresh_sink(self) -> receiver.Sink:
        """A sink over the engine's live parameters with nothing written; the parameters are
        looked up once per engine (a walk of the model is milliseconds on a large one)."""
        from megafleet_engine.refit_attempts import sinks

        with self._lock:
            template = self._sink
        if template is None:
            template = sinks.sink_for(self.engine.backend)
            with self._lock:
                self._sink = template
        return template.fresh()

    def live_pointers(self) -> dict[str, int]:
        """The parameters' storage addresses before a refit writes: those the last refit verified
        (nothing rebinds parameters between refits), read afresh the first time."""
        from megafleet_engine.refit_attempts import sinks

        with self._lock:
            known = self._pointers
        return known if known is not None else sinks.pointers(self.engine.backend)

    def verify_in_place(self, before: dict[str, int]) -> None:
        """Raise unless every parameter still has the storage it had ``before`` (a write rebound
        none: CUDA graphs captured on those addresses stay valid), and remember them."""
        from megafleet_engine.refit_attempts import sinks

        after = sinks.pointers(self.engine.backend)
        check_in_place(before, after)
        with self._lock:
            self._pointers = after

    @property
    def parked(self) -> bool:
        """Whether a transfer group (or a membership of NeMo's world) is kept for the next refit."""
        with self._lock:
            return self._parked is not None

    def park(self, kept: Kept) -> None:
        """Keep ``kept`` for the next refit, discarding what was kept before."""
        with self._lock:
            old, self._parked = self._parked, kept
        if old is not None:
            old.discard()

    def take_parked(self, when: Callable[[Kept], bool] = lambda kept: True) -> Kept | None:
        """Take what is kept (if ``when`` holds for it): the caller reuses it or discards it."""
        with self._lock:
            kept = self._parked
            if kept is None or not when(kept):
                return None
            self._parked = None
            return kept

    def discard_parked(self) -> None:
        kept = self.take_parked()
        if kept is not None:
            kept.discard()


def check_in_place(before: dict[str, int], after: dict[str, int]) -> None:
    """Raise :class:`RefitError` when a parameter's storage address changed (or one appeared or went)."""
    moved = sorted(name for name in before if after.get(name) != before[name])
    if moved or set(after) != set(before):
        raise errors.RefitError(f"parameters were rebound instead of written in place, e.g. {moved[:3]}")
