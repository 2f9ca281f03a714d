"""The weight target: the weights of one engine rank a refit's sources write into, and what a
successful refit keeps for the next one.

:class:`WeightTarget` is what sources (:mod:`megafleet_engine.refit_attempts.sources`) see; they
never learn which of its two implementations they write into:

* :class:`LiveTarget`: the live weights, written in place on the engine's backend thread while the
  engine is suspended or paused (today's behaviour). Owned by the refit controller
  (:mod:`megafleet_engine.refit_attempts.controller`, one per engine process), which also reads its
  ``dirty`` and ``parked`` for its admission and the status.
* :class:`StagingTarget`: the backend's staging copy (allocated once at engine start,
  :mod:`megafleet_engine.refit_staging`), written on the attempt's thread while the engine serves;
  the live weights change only at the switch. It shares the live target's parked group and dirty flag.

Every field is guarded by one lock of its own: the agent's routes, the attempt's thread and a join's
thread all touch it.

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
    import torch

    from megafleet_engine import engine as engine_module
    from megafleet_engine.backends import base
    from megafleet_protocol.refit import receiver

__all__ = ["Kept", "LiveTarget", "StagingTarget", "WeightTarget", "check_in_place"]


class Kept(Protocol):
    """What a successful refit keeps for the next one over the same world (a transfer group, a
    membership of NeMo's world), and the key of the requests that may reuse it."""

    @property
    def key(self) -> tuple[object, ...]: ...

    def discard(self) -> None:
        """Close it for good (any thread)."""


class WeightTarget(Protocol):
    """The weights a refit writes into (live or staged) and the group kept for the next refit."""

    @property
    def engine(self) -> engine_module.Engine: ...

    @property
    def rank(self) -> int:
        """This process's rank inside its shard."""
        ...

    @property
    def backend(self) -> base.Backend: ...

    @property
    def staged(self) -> bool:
        """Whether writes go into the staging copy (on the attempt's thread, while the engine serves)."""
        ...

    @property
    def dirty(self) -> bool:
        """The live weights were partly written by an attempt that did not complete."""
        ...

    def mark_dirty(self, dirty: bool) -> None: ...

    def fresh_sink(self) -> receiver.Sink:
        """A sink over the target's tensors with nothing written."""
        ...

    def tensors(self) -> dict[str, torch.Tensor]:
        """The target's tensors by name, as they hold the version written (the backend's parameters,
        or its staging copy): what a rank digests for the members' agreement."""
        ...

    def live_pointers(self) -> dict[str, int]:
        """The target's storage addresses before a refit writes."""
        ...

    def verify_in_place(self, before: dict[str, int]) -> None:
        """Raise unless every tensor still has the storage it had ``before``."""

    def load_checkpoint(self, path: str) -> int:
        """Load a checkpoint into the target's tensors (the caller picks the thread); returns how many."""
        ...

    @property
    def parked(self) -> bool: ...

    def park(self, kept: Kept) -> None: ...

    def take_parked(self, when: Callable[[Kept], bool] = ...) -> Kept | None: ...

    def discard_parked(self) -> None: ...


class LiveTarget:
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
    def staged(self) -> bool:
        return False

    def load_checkpoint(self, path: str) -> int:
        """Load a checkpoint into the live parameters (on the backend thread)."""
        backend = self.engine.backend
        backend.load_checkpoint(path)
        return len(backend.parameters())

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

    def tensors(self) -> dict[str, torch.Tensor]:
        """The engine's live parameters by name."""
        return self.engine.backend.parameters()

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


class StagingTarget:
    """The staging copy of one engine rank's backend; the parked group and the dirty flag are
    ``live``'s (the engine's, whichever target an attempt wrote into)."""

    def __init__(self, live: LiveTarget) -> None:
        self.live = live
        self._lock = threading.Lock()
        self._sink: receiver.Sink | None = None  # over the staging copy, nothing written (built once)

    @property
    def engine(self) -> engine_module.Engine:
        return self.live.engine

    @property
    def rank(self) -> int:
        return self.live.rank

    @property
    def backend(self) -> base.Backend:
        return self.live.backend

    @property
    def staged(self) -> bool:
        return True

    @property
    def dirty(self) -> bool:
        return self.live.dirty

    def mark_dirty(self, dirty: bool) -> None:
        self.live.mark_dirty(dirty)

    def fresh_sink(self) -> receiver.Sink:
        from megafleet_engine.refit_attempts import sinks

        with self._lock:
            template = self._sink
        if template is None:
            template = sinks.sink_for(sinks.Staged(self.backend))
            with self._lock:
                self._sink = template
        return template.fresh()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The staging copy by name (the names of the live parameters)."""
        from megafleet_engine.refit_attempts import sinks

        return sinks.Staged(self.backend).parameters()

    def live_pointers(self) -> dict[str, int]:
        """The staging copy's storage addresses (it is never rebound either)."""
        from megafleet_engine.refit_attempts import sinks

        return sinks.pointers(sinks.Staged(self.backend))

    def verify_in_place(self, before: dict[str, int]) -> None:
        from megafleet_engine.refit_attempts import sinks

        check_in_place(before, sinks.pointers(sinks.Staged(self.backend)))

    def load_checkpoint(self, path: str) -> int:
        """Load a checkpoint into the staging copy (on the attempt's thread, while serving)."""
        self.backend.load_checkpoint(path, staged=True)
        return len(self.backend.staged_parameters())

    @property
    def parked(self) -> bool:
        return self.live.parked

    def park(self, kept: Kept) -> None:
        self.live.park(kept)

    def take_parked(self, when: Callable[[Kept], bool] = lambda kept: True) -> Kept | None:
        return self.live.take_parked(when)

    def discard_parked(self) -> None:
        self.live.discard_parked()
