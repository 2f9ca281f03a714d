"""The refit watchdog: a thread that ends an attempt that outlives its deadline.

Started by each refit attempt (:mod:`megafleet_engine.refit_attempts.attempt`) when the agent accepts it,
and stopped when the attempt ends. If the deadline comes first it calls the attempt's abort, which
marks the engine ``stale``, records the failure and aborts the attempt's process group, so blocked
collectives return (an HTTP abort could not do this on its own: the transfer thread is blocked inside
the collective). A staged attempt that waits for its commit moves it by its grace
(:meth:`Watchdog.extend`). It runs in its own thread so that it fires even while the attempt's
thread is blocked, and never touches the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Watchdog"]

log = logging.getLogger(__name__)


class Watchdog:
    """Call ``on_expire`` once, ``seconds`` after :meth:`start`, unless :meth:`stop` came first."""

    def __init__(
        self, seconds: float, on_expire: Callable[[], None], *, name: str = "megafleet-refit-watchdog"
    ) -> None:
        self.seconds = seconds
        self._on_expire = on_expire
        self._lock = threading.Lock()
        self._at = 0.0  # when it fires (monotonic), set by start and moved by extend
        self._stopped = threading.Event()
        self._fired = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)

    @property
    def fired(self) -> bool:
        return self._fired.is_set()

    def start(self) -> None:
        with self._lock:
            self._at = time.monotonic() + self.seconds
        self._thread.start()

    def extend(self, seconds: float) -> None:
        """Fire ``seconds`` later than planned (a staged attempt waiting for its commit: its grace)."""
        with self._lock:
            self._at += seconds

    def stop(self) -> None:
        """Disarm (idempotent); returns at once, even from ``on_expire`` itself."""
        self._stopped.set()

    def _watch(self) -> None:
        while True:
            with self._lock:
                left = self._at - time.monotonic()
            if left <= 0:
                break
            if self._stopped.wait(left):
                return
        self._fired.set()
        try:
            self._on_expire()
        except Exception:  # a watchdog must not die silently with the attempt still blocked
            log.exception("the refit watchdog's abort failed")
