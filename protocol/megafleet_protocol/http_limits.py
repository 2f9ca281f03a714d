"""The bounds of the engine pod's HTTP servers, as plain values (no server code).

Read from ``MEGAFLEET_*`` variables by :mod:`megafleet_engine.settings` (where each variable and its
default are documented), passed by :mod:`megafleet_engine.cli` to
:class:`~megafleet_engine.server.EngineServers` and on to each API-server process, and enforced by
:mod:`megafleet_engine.http_server`, which says what each bound does.
"""

from __future__ import annotations

import dataclasses

__all__ = ["AGENT_MAX_CONNECTIONS", "DEFAULTS", "FRONTEND_MAX_CONNECTIONS", "MIB", "HttpBounds", "HttpLimits"]

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """The bounds of one of the pod's HTTP servers, enforced by :mod:`megafleet_engine.http_server`
    (which says what each one does). The defaults here are the documented ones; the variables that
    change them are ``MEGAFLEET_HTTP_*`` and ``MEGAFLEET_*_MAX_CONNECTIONS``
    (:class:`megafleet_engine.settings.Settings`)."""

    max_connections: int
    """Open connections one server holds at most; one more is answered 503 and closed."""
    header_timeout_seconds: int = 10
    """Longest a request's head (request line and headers) may take to arrive whole."""
    stall_timeout_seconds: int = 60
    """Longest a request body may stop arriving, or a client stop reading its response."""
    keep_alive_seconds: int = 75
    """Longest an idle connection is kept between two requests."""
    max_body_bytes: int = 64 * MIB
    """Largest request body."""


FRONTEND_MAX_CONNECTIONS = 4096
"""Default connections per frontend server process (each API-server process, or the rank process
that serves the frontend itself)."""
AGENT_MAX_CONNECTIONS = 64
"""Default connections of the agent (only the operator and the pod's own ranks call it) and of the
metrics server (scrapers)."""


@dataclasses.dataclass(frozen=True)
class HttpBounds:
    """The limits of the frontend and of the agent and metrics servers."""

    frontend: HttpLimits = HttpLimits(FRONTEND_MAX_CONNECTIONS)
    agent: HttpLimits = HttpLimits(AGENT_MAX_CONNECTIONS)


DEFAULTS = HttpBounds()
"""The documented defaults (what a server built without explicit bounds gets)."""
