"""Why the engine exited, written where the kubelet reads a container's termination message.

Called by :mod:`megafleet_engine.cli` on every exit that is an error: settings the engine refuses, a
missing Secret, a rank that failed to load or serve, a rank process that died. The kubelet copies
the file (``/dev/termination-log`` unless ``MEGAFLEET_TERMINATION_LOG`` names another:
:func:`megafleet_protocol.engine_settings.termination_log`) into the pod's
``status.containerStatuses[].state.terminated.message`` (``lastState`` once restarted), where the
operator reads it into the shard's ``lastError``, an Event and the fleet's ``Degraded`` condition.
"""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["DEFAULT_PATH", "MAX_BYTES", "record"]

log = logging.getLogger(__name__)

MAX_BYTES = 4096
"""The most the kubelet keeps of one container's termination message."""
DEFAULT_PATH = Path("/dev/termination-log")
"""Kubernetes' default ``terminationMessagePath``, which the operator's pods keep."""


def record(reason: str, path: Path | None) -> None:
    """Write ``reason`` (cut to :data:`MAX_BYTES`) to ``path`` (``MEGAFLEET_TERMINATION_LOG``; None:
    :data:`DEFAULT_PATH` where the kubelet made it, else nowhere), unless it holds one already: the
    first failure is the cause, and the ranks it stops would only repeat it. Never raises: the engine
    is exiting anyway, and its log says the same."""
    if path is None:
        if not DEFAULT_PATH.exists():
            return
        path = DEFAULT_PATH
    try:
        if path.exists() and path.stat().st_size > 0:
            return
        cut = reason.encode(errors="replace")[:MAX_BYTES].decode(errors="ignore")  # whole characters only
        path.write_text(cut)
    except OSError as error:
        log.warning("could not write the termination message to %s: %s", path, error)
