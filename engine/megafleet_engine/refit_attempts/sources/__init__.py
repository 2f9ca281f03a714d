"""Where a refit's weights come from: one module per source, behind the :class:`Source` protocol.

Each module holds its request's dataclass (what the agent's route builds from the body) and its
source (what one attempt of that request does on the attempt's thread):

* :mod:`~megafleet_engine.refit_attempts.sources.rendezvous`: the megafleet wire from a trainer
  using the SDK (broadcast or reshard), over a transfer group parked between refits;
* :mod:`~megafleet_engine.refit_attempts.sources.checkpoint`: a checkpoint every shard reads itself;
* :mod:`~megafleet_engine.refit_attempts.sources.nemo_collective`: an unmodified NeMo RL trainer's
  packed broadcast, over NeMo's world joined once (by the first refit or by a session's join);
* :mod:`~megafleet_engine.refit_attempts.sources.megatron_swap`: megatron-core's own
  ``swap_model_weights`` over a refit group joined for a session.

The refit controller (:mod:`megafleet_engine.refit_attempts.controller`) asks a request for its
source (:meth:`Request.source`, before it admits the attempt) and the attempt
(:mod:`megafleet_engine.refit_attempts.attempt`) drives the source through its phases; neither looks
at which kind it runs. A source acts on the :class:`Run` it is handed (the attempt's record,
deadline, suspend, backend thread and the weight target), never on the controller. Adding a source
is one module here and the agent route that builds its request.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from megafleet_protocol import vocabulary

if TYPE_CHECKING:
    from megafleet_engine.refit_attempts import phases, weight_target
    from megafleet_protocol.refit import communicator, deadlines

__all__ = ["Request", "Run", "Source", "Unfit"]

K = TypeVar("K", bound="weight_target.Kept")


class Unfit(ValueError):
    """The request does not fit this engine, and its trainer cannot hear the refusal (it waits in a
    collective that times out): what was kept for the next refit is dropped too."""


class Run(Protocol):
    """What a running attempt offers its source, on the attempt's thread."""

    @property
    def target(self) -> weight_target.WeightTarget:
        """The weights written into: live or staged, sources need not know (fresh sink, storage
        addresses, the in-place check, a checkpoint load)."""
        ...

    @property
    def record(self) -> phases.Progress:
        """The attempt's record: the source enters its phases, times them and counts what it took in."""
        ...

    @property
    def deadline(self) -> communicator.Deadline:
        """When the attempt must be over (its ``timeout_seconds`` from its start)."""
        ...

    @property
    def aborted(self) -> threading.Event:
        """Set when the attempt is aborted (a communicator's abort flag, also before it exists)."""
        ...

    def start_suspend(self) -> concurrent.futures.Future[None]:
        """Start holding the engine for the writes, to overlap with a join (the attempt cancels it at
        its end if it has not ended): suspend it (drain, abort), pause it at a step boundary (keep),
        or nothing (a staged attempt: the engine serves on); nothing may be received or written
        before it ended."""
        ...

    def wait_suspended(self, suspended: concurrent.futures.Future[None]) -> None:
        """Wait until the hold started by :meth:`start_suspend` is in place, until the deadline."""

    def suspend(self) -> None:
        """Hold the engine and wait until it is held (a source that builds nothing meanwhile)."""

    def apply(self, write: Callable[[], int]) -> int:
        """Run ``write`` where the target's tensors may be written (the backend thread for the live
        weights, which marks the engine dirty; the attempt's thread for the staging copy), unless the
        attempt ended meanwhile."""
        ...

    def take_parked(self, key: tuple[object, ...], kind: type[K]) -> K | None:
        """What the last successful refit kept, if it is a ``kind`` serving ``key``; anything else
        kept is discarded."""
        ...

    def drop_parked(self) -> None:
        """Discard what the last successful refit kept (another kind of refit: the next one joins afresh)."""

    def wait_for_commit(self, decide: Callable[[deadlines.Deadline], None] | None = None) -> None:
        """Staged under a trainer's or operator's commit: report ``staged`` and wait for the commit
        until the deadline plus the grace (``decide``: how the source waits for its trainer's);
        nothing otherwise. A source that does not call it gets the operator's wait after
        :meth:`Source.run` returns."""


class Source(Protocol):
    """One attempt's source of weights, made by :meth:`Request.source` for one attempt.

    The attempt calls :meth:`record` and :meth:`describe` once when it is made, :meth:`run` on its
    thread, then :meth:`keep` and :meth:`report` when it commits (or :meth:`report` when it fails),
    :meth:`abort` from any thread when it ends early, and :meth:`close` when its thread ends.
    """

    @property
    def request(self) -> Request:
        """The request this source serves."""
        ...

    def record(self) -> phases.Progress:
        """The attempt's fresh record (its source, transport, rank and world as the status reports them)."""
        ...

    def describe(self) -> str:
        """The request for the log line that starts the attempt."""
        ...

    def run(self, run: Run) -> None:
        """Suspend, join, receive or apply, and verify the weights in place (on the attempt's thread);
        raises on failure. The engine is resumed by the attempt once this returns."""

    def keep(self, target: weight_target.WeightTarget) -> None:
        """The engine serves the new version: park what the next refit over the same world reuses
        (before the success shows, so the next refit's call finds it parked)."""

    def report(self, error: str | None) -> None:
        """Tell the trainer the outcome, once and best effort: after the success shows (``None``),
        or on failure before the abort tears the group down."""

    def abort(self, reason: str) -> None:
        """The attempt ended early (any thread, never blocks): unblock whatever it waits in."""

    def close(self) -> None:
        """The attempt's thread ends: close what was not kept."""

    def runs_over(self, session: str) -> bool:
        """Whether this refit runs over NeMo's world joined for ``session`` (leaving it ends the refit)."""
        ...


class Request(Protocol):
    """A refit request as the controller admits it (a frozen dataclass of a source's module)."""

    @property
    def version(self) -> int: ...

    @property
    def timeout_seconds(self) -> float: ...

    @property
    def suspend_mode(self) -> vocabulary.InFlightMode:
        """What the refit does with the sequences in flight (the agent body's ``suspendMode``)."""
        ...

    @property
    def staging(self) -> vocabulary.StagingMode:
        """Whether the refit receives into the engine's staging copy while it serves."""
        ...

    @property
    def kv_cache_mode(self) -> vocabulary.KvCacheMode | None: ...

    @property
    def commit(self) -> vocabulary.CommitMode:
        """Who lets a staged version go live (the agent body's ``commit``)."""
        ...

    @property
    def commit_grace_seconds(self) -> float:
        """How long past its deadline a staged attempt waits for its commit."""
        ...

    @property
    def key(self) -> tuple[object, ...]:
        """What makes two requests the same attempt (a repeated call is answered, not rerun)."""
        ...

    def source(self, target: weight_target.WeightTarget) -> Source:
        """This request's source for one attempt on ``target``'s rank; :class:`ValueError` (or
        :class:`Unfit`) for a request this rank cannot take, before anything is suspended."""
        ...
