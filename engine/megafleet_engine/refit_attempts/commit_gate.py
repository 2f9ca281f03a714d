"""Where a staged refit attempt waits for its commit, and how the commit reaches it.

A staged attempt whose commit is the operator's (``commit: operator``) holds a :class:`CommitGate`:
the attempt's thread waits in :meth:`CommitGate.wait` once its copy is staged and verified (the phase
``staged``), the agent's ``POST /v1/refit/commit`` opens it (:meth:`CommitGate.open`, through the
refit controller), and an abort shuts it (:meth:`CommitGate.shut`). A wait that outlives its
deadline (the attempt's ``timeoutSeconds`` plus ``commitGraceSeconds``) raises
:class:`~megafleet_protocol.refit.errors.CommitExpired`: the attempt fails, its staged copy is
discarded and the engine serves the old version on. The trainer's commit (``commit: trainer``) does
not come through the gate: the rendezvous source waits for the trainer's ``commit`` key itself
(:mod:`megafleet_protocol.refit.commit_round`).

Used by the refit attempt (:mod:`megafleet_engine.refit_attempts.attempt`); any thread may open or
shut the gate, only the attempt's thread waits.
"""

from __future__ import annotations

import threading

from megafleet_protocol.refit import errors

__all__ = ["CommitGate"]


class CommitGate:
    """One attempt's commit: undecided, opened (go) or shut (with the reason)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._open = False
        self._shut: str | None = None

    @property
    def opened(self) -> bool:
        with self._changed:
            return self._open

    def open(self) -> bool:
        """Let the staged version go live; ``False`` when the gate was shut first (idempotent)."""
        with self._changed:
            if self._shut is not None:
                return False
            self._open = True
            self._changed.notify_all()
            return True

    def shut(self, reason: str) -> None:
        """The attempt ended: a wait returns with ``reason`` (no effect once opened)."""
        with self._changed:
            if not self._open and self._shut is None:
                self._shut = reason
                self._changed.notify_all()

    def wait(self, seconds: float, expired: str) -> None:
        """Wait until the gate opens (returns), is shut (:class:`RefitAborted`) or ``seconds`` pass
        (:class:`~megafleet_protocol.refit.errors.CommitExpired`
        with the message ``expired``)."""
        with self._changed:
            self._changed.wait_for(lambda: self._open or self._shut is not None, timeout=max(seconds, 0.0))
            if self._open:
                return
            if self._shut is not None:
                raise errors.RefitAborted(self._shut)
        raise errors.CommitExpired(expired)
