"""Growing delays between retries of an operator action that keeps failing.

Used by :mod:`megafleet.reconcile.catch_up` for a shard's catch-up from a peer or from the fleet's
current checkpoint, each source its own key: a checkpoint that cannot be loaded (missing on that
node, corrupt, the wrong shape) is tried again after 10 s, 20 s, 40 s, ... up to 5 minutes
(:class:`megafleet.settings.CatchUpSettings`), not at every reconcile. Kept in the operator's memory
(Kopf's ``memo``), as client-go's rate limiters are: an operator that restarts (or a new leader)
starts the delays over.
Pure: the caller passes the clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

__all__ = ["Backoff"]


@dataclasses.dataclass
class _Entry:
    failures: int
    next_at: float
    retried: bool = False  # the action ran again since the last failure was counted


class Backoff:
    """Per-key retry delays: ``first_seconds`` after the first failure, doubling up to ``most_seconds``."""

    def __init__(self, *, first_seconds: float, most_seconds: float) -> None:
        self.first_seconds = first_seconds
        self.most_seconds = most_seconds
        self._entries: dict[Hashable, _Entry] = {}

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row."""
        return min(self.first_seconds * 2.0 ** max(failures - 1, 0), self.most_seconds)

    def wait(self, key: Hashable, *, failed: bool, now: float) -> tuple[float, int | None]:
        """Seconds before the action for ``key`` may run again (0: now), and the failure count when
        this call is the first to see its last run failed (``None`` otherwise).

        ``failed``: the action's last run for ``key`` failed. A failure counts once: the next one is
        a failure of the run allowed after it."""
        if not failed:
            self._entries.pop(key, None)
            return 0.0, None
        entry = self._entries.get(key)
        counted = None
        if entry is None or entry.retried:
            failures = 1 if entry is None else entry.failures + 1
            entry = _Entry(failures, now + self.delay(failures))
            self._entries[key] = entry
            counted = failures
        left = entry.next_at - now
        if left > 0:
            return left, counted
        entry.retried = True
        return 0.0, counted

    def left(self, key: Hashable, *, now: float) -> float:
        """Seconds before the action for ``key`` may run again (0: now), counting nothing: for an
        action whose last run was not the last one of its kind (another source ran since)."""
        entry = self._entries.get(key)
        return 0.0 if entry is None else max(entry.next_at - now, 0.0)

    def retrying(self, key: Hashable) -> None:
        """The action for ``key`` runs again now (it was due by :meth:`left`): its next failure counts."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.retried = True

    def forget(self, keep: Callable[[Hashable], bool]) -> None:
        """Drop every key for which ``keep`` is false (an action that no longer applies)."""
        self._entries = {key: entry for key, entry in self._entries.items() if keep(key)}

    def failures(self, key: Hashable) -> int:
        entry = self._entries.get(key)
        return entry.failures if entry is not None else 0
