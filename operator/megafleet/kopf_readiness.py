"""Keep Kopf's index readiness from waiting on watchers that are gone (a Kopf 1.45 defect).

Installed by :func:`megafleet.operator_main.run` before Kopf starts. Kopf holds every handler until
all its indexes are filled: each watcher of an indexed resource (per namespace when the operator
watches namespace globs) owns an "indexed" toggle, dropped once its first LIST is through, and each
object seen during that LIST owns one more, dropped once it is indexed. A watcher that is cancelled
before its LIST finished (its namespace was deleted meanwhile, the usual case in a cluster where
namespaces come and go) never drops its toggles, and from then on no handler of the operator runs
again: fleets stay without status for good. The e2e tier hit it when the operator started while a
test namespace was being deleted (``docs/incidents.md#kopf-index-readiness``).

:func:`install` wraps Kopf's per-resource watcher so that every readiness toggle made by or for one
watcher is dropped when that watcher ends, however it ends. A watcher that ended can no longer
make its resource ready, so readiness must not wait for it; a namespace that comes back gets a new
watcher with new toggles.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kopf._cogs.aiokits import aiotoggles
from kopf._core.reactor import queueing

__all__ = ["OwnedToggles", "install", "release_on_exit"]

log = logging.getLogger(__name__)

_REQUIRED = ("operator_indexed", "resource_indexed")
"""The watcher's parameters the fix relies on (Kopf 1.37 to 1.45 have both)."""

Watcher = Callable[..., Coroutine[Any, Any, None]]


class OwnedToggles:
    """One watcher's view of the operator-wide readiness set: what Kopf's watcher, its workers and
    their processing call on it (make, drop, check, wait) goes to ``shared``, and the toggles made
    here (and the watcher's own) are remembered, so they can all be dropped at once."""

    def __init__(self, shared: aiotoggles.ToggleSet, own: aiotoggles.Toggle | None) -> None:
        self.shared = shared
        self.made: set[aiotoggles.Toggle] = {own} if own is not None else set()

    async def make_toggle(self, value: bool = False, *, name: str | None = None) -> aiotoggles.Toggle:
        toggle = await self.shared.make_toggle(value, name=name)
        self.made.add(toggle)
        return toggle

    async def drop_toggle(self, toggle: aiotoggles.Toggle) -> None:
        self.made.discard(toggle)
        await self.shared.drop_toggle(toggle)

    async def release(self) -> None:
        """Drop every toggle still held for this watcher."""
        held, self.made = self.made, set()
        if held:
            await self.shared.drop_toggles(held)

    def is_on(self) -> bool:
        return self.shared.is_on()

    async def wait_for(self, state: bool) -> None:
        await self.shared.wait_for(state)


def release_on_exit(watcher: Watcher) -> Watcher:
    """``watcher`` (Kopf's ``queueing.watcher``) with its readiness toggles dropped when it ends."""

    async def watch(
        *,
        operator_indexed: aiotoggles.ToggleSet | None = None,
        resource_indexed: aiotoggles.Toggle | None = None,
        **kwargs: Any,
    ) -> None:
        if operator_indexed is None:
            await watcher(operator_indexed=None, resource_indexed=resource_indexed, **kwargs)
            return
        owned = OwnedToggles(operator_indexed, resource_indexed)
        try:
            await watcher(operator_indexed=owned, resource_indexed=resource_indexed, **kwargs)
        finally:
            release = asyncio.ensure_future(owned.release())
            while not release.done():  # finish even when cancelled again while releasing
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(release)

    watch.__wrapped__ = watcher  # type: ignore[attr-defined]
    return watch


def install() -> bool:
    """Wrap Kopf's watcher (once). False, with a warning, when this Kopf's watcher lacks the
    parameters the fix relies on: then it runs unwrapped."""
    current = queueing.watcher
    if hasattr(current, "__wrapped__"):
        return True
    parameters = inspect.signature(current).parameters
    if not all(name in parameters for name in _REQUIRED):
        log.warning("Kopf's watcher has no %s: index-readiness fix not installed", " or ".join(_REQUIRED))
        return False
    queueing.watcher = release_on_exit(current)
    return True
