"""Restart Kopf in this process when it stopped serving the operator's resources.

Called by :func:`megafleet.operator_main.run`. Kopf decides which resources to watch from the API
server's discovery: at start-up, and again for a group whenever one of its CRDs changes. An API
server that is starting (a restart, a control-plane upgrade) can answer discovery without the custom
resource groups for a moment; a scan in that moment makes Kopf log "Unresolved resources cannot be
served" and stop watching them, and only a later change of a CRD would make it look again, so the
operator would sit idle. The chaos drill with API server restarts found it (``tests/chaos``; see
``docs/incidents.md#kopf-discovery-after-restart``).

The supervisor runs Kopf, and when Kopf logs that warning it stops Kopf (its ``stop_flag``) and starts
it again after a back-off (doubling from :data:`FIRST_BACKOFF_SECONDS` to :data:`MAX_BACKOFF_SECONDS`,
reset by a run that lasted longer than the cap), so its fresh scan sees the resources once discovery
lists them. Handlers are level-based, so a restart only re-observes. A normal stop (a signal) ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["FIRST_BACKOFF_SECONDS", "MAX_BACKOFF_SECONDS", "UNRESOLVED", "Unresolved", "supervise"]

log = logging.getLogger(__name__)

UNRESOLVED = "Unresolved resources cannot be served"
"""The start of Kopf's warning (logger ``kopf._core.reactor.observation``) when resources it should
watch are missing from discovery."""
KOPF_OBSERVER_LOGGER = "kopf._core.reactor.observation"
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0


class Unresolved(logging.Handler):
    """Sets ``event`` (on ``loop``) when a record says Kopf cannot serve some resources."""

    def __init__(self, event: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(level=logging.WARNING)
        self.event = event
        self.loop = loop

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(UNRESOLVED):
            self.loop.call_soon_threadsafe(self.event.set)


async def supervise(run_kopf: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> int:
    """Run ``run_kopf(stop_flag)`` until it returns by itself; restart it whenever Kopf reports
    unresolved resources. Returns the number of restarts (for tests)."""
    restarts, backoff = 0, FIRST_BACKOFF_SECONDS
    observer = logging.getLogger(KOPF_OBSERVER_LOGGER)
    while True:
        unresolved, stop = asyncio.Event(), asyncio.Event()
        handler = Unresolved(unresolved, asyncio.get_running_loop())
        observer.addHandler(handler)
        started = asyncio.get_running_loop().time()
        kopf_task = asyncio.create_task(run_kopf(stop))
        lost = asyncio.create_task(unresolved.wait())
        try:
            done, _ = await asyncio.wait({kopf_task, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            observer.removeHandler(handler)
            lost.cancel()
        if kopf_task in done:
            await kopf_task  # a normal stop (or its error)
            return restarts
        stop.set()
        await kopf_task
        if asyncio.get_running_loop().time() - started > MAX_BACKOFF_SECONDS:
            backoff = FIRST_BACKOFF_SECONDS
        restarts += 1
        log.warning("Kopf stopped serving the operator's resources; restart %d in %.0f s", restarts, backoff)
        if await _signalled_within(backoff):
            return restarts
        backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)


async def _signalled_within(seconds: float) -> bool:
    """Wait out the back-off (discovery is filled asynchronously); True if SIGTERM or SIGINT came
    meanwhile. Kopf's own handlers are installed only while it runs (and not removed after), so
    ours replace them here."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    installed = []
    for number in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(number, signalled.set)
            installed.append(number)
    try:
        await asyncio.wait_for(signalled.wait(), timeout=seconds)
    except TimeoutError:
        return False
    finally:
        for number in installed:
            loop.remove_signal_handler(number)
    return True
