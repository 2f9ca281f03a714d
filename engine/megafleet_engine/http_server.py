"""Every HTTP server of an engine pod, bounded: the frontend (in the rank process or in each
API-server process), the agent and the metrics server.

Called by :mod:`megafleet_engine.server` and :mod:`megafleet_engine.api_server`, which build each of
their uvicorn servers with :func:`config`. Alone, uvicorn bounds how long an idle connection stays
between two requests (``timeout_keep_alive``) and how large a request head may be (h11's limit), but
not how long a client may take to send a head or a body, how long it may leave a response unread,
how large a body it may send, or how many connections it may hold open. The rest is added here, as
production HTTP servers set it (nginx's names in brackets); the values are
:class:`~megafleet_engine.http_limits.HttpLimits`:

* Head timeout [``client_header_timeout``]: a request's head (request line and headers) must arrive
  whole within ``header_timeout_seconds``, counted from when the connection opened, or for a
  kept-alive connection's next request from its first byte (until then keep-alive's own timeout
  applies). Else the connection is closed: with a ``408`` when part of a head came, silently when
  nothing did (as at keep-alive's end, where a client must expect it).
* Stall timeout [``client_body_timeout``, ``send_timeout``]: a connection is closed when a request
  body stops arriving for ``stall_timeout_seconds`` (``408`` if no response began) or when the client
  reads nothing of a response for as long while more is waiting to be sent; its request is cancelled
  as if the client had gone. A body the server itself stopped reading (the app has not read what
  came yet) is not the client's stall.
* Keep-alive [``keepalive_timeout``]: uvicorn's ``timeout_keep_alive``, ``keep_alive_seconds``.
* Connection limit [HAProxy's ``maxconn``]: one server holds at most ``max_connections`` open
  connections. One more is answered ``503`` with an OpenAI error body and ``Retry-After: 1`` at once,
  without reading its request; the server stops sending, discards what the client sends for at most
  :data:`REFUSED_LINGER_SECONDS` (so the client reads the answer rather than a reset) and closes it.
* Body limit [``client_max_body_size``]: :class:`BodyLimit` answers ``413`` (and closes the
  connection) for a request whose ``Content-Length`` or body read so far exceeds ``max_body_bytes``,
  before the app holds more of it than that.
* Head size [``large_client_header_buffers``]: h11's 16 KiB (:data:`MAX_HEAD_BYTES`); a larger head
  is answered ``400`` by uvicorn.
* Lame duck [Envoy's drain period], the frontend only: a stopping frontend finishes the responses in
  flight (uvicorn's graceful shutdown) but, unlike uvicorn, does not close an idle kept-alive
  connection at once: a client may be sending its next request on it at that moment, and would read
  "server disconnected without sending a response" for a request that was never seen. The
  connection stays open for :data:`LAME_DUCK_SECONDS` (longer than common clients keep an idle
  connection: httpx's and the ``openai`` client's 5 s); a request arriving on it meanwhile is
  answered ``503`` with ``Retry-After`` and ``Connection: close`` without reaching the app (a client
  retries it on another shard), and one still idle then is closed. The agent's and the metrics
  server's clients (the operator, Prometheus) retry on their own: they close idle ones at once.

Every server speaks HTTP/1.1 through h11 (:class:`BoundedH11Protocol`, uvicorn's h11 protocol with a
few timers per connection), whether or not httptools is installed, so these bounds always hold; no
server takes WebSocket upgrades. A process that serves up to N connections needs N file descriptors
beside its own: :func:`allow_open_files` raises the process's soft limit toward its hard one (as
Go's runtime does at start), since containerd 2 starts containers with a soft limit of 1,024.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Any, ClassVar, cast

import fastapi
import h11
import starlette.exceptions
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http import h11_impl

from megafleet_protocol import http_limits

__all__ = [
    "LAME_DUCK_SECONDS",
    "MAX_HEAD_BYTES",
    "REFUSED_LINGER_SECONDS",
    "BodyLimit",
    "BoundedH11Protocol",
    "allow_open_files",
    "config",
    "protocol_for",
]

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
"""Largest request head (request line and headers), h11's own default made explicit."""
REFUSED_LINGER_SECONDS = 1.0
"""How long a connection refused for the connection limit is read (and discarded) before it closes."""
WARN_EVERY_SECONDS = 10.0
"""Shortest interval between two log lines about refused connections of one server."""
GRACEFUL_SHUTDOWN_SECONDS = 10
"""How long a stopping server waits for responses in flight before closing their connections."""
LAME_DUCK_SECONDS = 6.0
"""How long a stopping frontend keeps an idle kept-alive connection open (below
:data:`GRACEFUL_SHUTDOWN_SECONDS`, above the 5 s for which httpx and the ``openai`` client keep one)."""
OWN_FILES = 1024
"""File descriptors a serving process keeps for itself beside its connections (files, pipes, IPC)."""


def config(app: fastapi.FastAPI, limits: http_limits.HttpLimits, *, name: str) -> uvicorn.Config:
    """The uvicorn configuration of one of the pod's servers (``name``: frontend, agent, metrics)."""
    return uvicorn.Config(
        BodyLimit(app, max_bytes=limits.max_body_bytes),
        http=protocol_for(limits, name=name),
        ws="none",
        lifespan="off",
        log_config=None,  # the process configures logging once
        log_level="warning",  # start/stop lines come from the callers, once per server
        access_log=False,
        timeout_keep_alive=limits.keep_alive_seconds,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )


def allow_open_files(connections: int) -> int:
    """Raise this process's soft limit of open files so it can hold ``connections`` connections
    beside :data:`OWN_FILES` of its own, up to the hard limit (logged when that is too low: the
    kernel then refuses connections before the servers' limits do). Returns the soft limit now."""
    wanted = connections + OWN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        log.warning(
            "the open-files limit (hard %d) is below the %d this process's servers may need for %d connections",
            hard,
            wanted,
            connections,
        )
    return max(target, soft)


def protocol_for(limits: http_limits.HttpLimits, *, name: str) -> type[BoundedH11Protocol]:
    """:class:`BoundedH11Protocol` for one server (uvicorn takes a protocol class, built per connection)."""
    lame_duck = LAME_DUCK_SECONDS if name == "frontend" else 0.0
    attributes = {"limits": limits, "server_name": name, "lame_duck_seconds": lame_duck}
    bound = type(f"BoundedH11Protocol[{name}]", (BoundedH11Protocol,), attributes)
    return cast(type[BoundedH11Protocol], bound)


def _answer(status: int, reason: str, error: dict[str, Any], *headers: str) -> bytes:
    """A whole ``Connection: close`` response with an OpenAI error body, for a connection the server
    closes right after (written below h11, which never sees it)."""
    body = json.dumps({"error": {"param": None, **error}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}"]
    head += [*headers, "connection: close", "", ""]
    return "\r\n".join(head).encode() + body


class BoundedH11Protocol(h11_impl.H11Protocol):
    """uvicorn's h11 protocol with the head and stall timeouts and the connection limit of the module
    docstring. :func:`protocol_for` makes one subclass per server with its ``limits``."""

    limits: ClassVar[http_limits.HttpLimits]
    server_name: ClassVar[str] = "http"
    lame_duck_seconds: ClassVar[float] = 0.0
    _last_warning: ClassVar[float] = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._lame_duck: asyncio.TimerHandle | None = None
        self._refused = False
        self._stopping = False

    # -- connection limit ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.limits.header_timeout_seconds, self._head_timed_out)

    def _refuse(self, transport: asyncio.Transport) -> None:
        self._refused = True
        self.transport = transport
        cls = type(self)
        now = time.monotonic()
        if now - cls._last_warning >= WARN_EVERY_SECONDS:
            cls._last_warning = now
            log.warning(
                "the %s server holds its limit of %d open connections; refusing more with 503",
                self.server_name,
                self.limits.max_connections,
            )
        message = f"this server holds its limit of {self.limits.max_connections} open connections; retry"
        error = {"message": message, "type": "service_unavailable", "code": "too_many_connections"}
        transport.write(_answer(503, "Service Unavailable", error, "retry-after: 1"))
        if transport.can_write_eof():
            transport.write_eof()
        self._linger = self.loop.call_later(REFUSED_LINGER_SECONDS, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # discarded: the answer is sent, the connection closes
        if self._stopping:
            self._answer_stopping()
            return
        super().data_received(data)
        self._retime()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._retime()  # a pipelined request may have started

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._send_timer, self._linger, self._lame_duck):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._send_timer = self._linger = self._lame_duck = None
        super().connection_lost(exc)

    # -- lame duck -----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """The server is stopping: a response in flight ends the connection when it completes
        (uvicorn's way); an idle connection waits out the lame-duck period (module docstring)."""
        idle = self.cycle is None or self.cycle.response_complete
        if not idle or self.transport.is_closing() or self.lame_duck_seconds <= 0:
            super().shutdown()
            return
        self._stopping = True
        if self.conn.trailing_data[0]:  # part of the next request came already
            self._answer_stopping()
            return
        self._lame_duck = self.loop.call_later(self.lame_duck_seconds, self._lame_duck_over)

    def _lame_duck_over(self) -> None:
        self._lame_duck = None
        if not self.transport.is_closing():
            super().shutdown()

    def _answer_stopping(self) -> None:
        """Answer the request that came on an idle connection of a stopping server, and close it."""
        self._refused = True
        if self._lame_duck is not None:
            self._lame_duck.cancel()
            self._lame_duck = None
        message = f"the {self.server_name} server is shutting down; retry on another server"
        error = {"message": message, "type": "service_unavailable", "code": "shutting_down"}
        self.transport.write(_answer(503, "Service Unavailable", error, "retry-after: 1"))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(REFUSED_LINGER_SECONDS, self.transport.close)

    # -- head and body timeouts --------------------------------------------------------------------

    def _retime(self) -> None:
        """After the client sent something: time the head while one is awaited and part of it has
        come (the one timed from the connection's start stays), or the body's next piece while a
        body is being received."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._head_timer is None and self.conn.trailing_data[0]:
                self._head_timer = self.loop.call_later(self.limits.header_timeout_seconds, self._head_timed_out)
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if state is h11.SEND_BODY:
            self._body_timer = self.loop.call_later(self.limits.stall_timeout_seconds, self._body_stalled)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        seconds = self.limits.header_timeout_seconds
        if self.conn.trailing_data[0]:  # part of a head came: say why the connection ends
            message = f"the request's head did not arrive within {seconds} s"
            error = {"message": message, "type": "timeout_error", "code": "request_timeout"}
            self.transport.write(_answer(408, "Request Timeout", error))
        log.debug("%s server: closing a connection that sent no whole request head in %d s", self.server_name, seconds)
        self.transport.close()

    def _body_stalled(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        seconds = self.limits.stall_timeout_seconds
        if self.flow.read_paused:  # the server stopped reading, not the client sending
            self._body_timer = self.loop.call_later(seconds, self._body_stalled)
            return
        if self.cycle is not None and not self.cycle.response_started:
            message = f"the request's body stopped arriving for {seconds} s"
            error = {"message": message, "type": "timeout_error", "code": "request_timeout"}
            self.transport.write(_answer(408, "Request Timeout", error))
        log.info("%s server: closing a connection whose request body stalled for %d s", self.server_name, seconds)
        self.transport.close()

    # -- send stall --------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        if self._refused:
            return  # nothing of uvicorn's was set up: the answer is tiny and the connection closing
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.stall_timeout_seconds, self._send_stalled)

    def resume_writing(self) -> None:
        if self._refused:
            return
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_stalled(self) -> None:
        self._send_timer = None
        if self.transport.is_closing() or not self.flow.write_paused:
            return
        log.info(
            "%s server: closing a connection whose client read nothing for %d s",
            self.server_name,
            self.limits.stall_timeout_seconds,
        )
        self.transport.abort()  # what is buffered can never be delivered; the request is cancelled


class BodyLimit:
    """ASGI middleware: a request whose body exceeds ``max_bytes`` (its ``Content-Length``, or what
    was read of it so far) is answered ``413`` with ``Connection: close``.

    The limit is checked where the app reads the body (uvicorn buffers at most 64 KiB beyond what
    the app read, so nothing larger is ever held); the error is a Starlette ``HTTPException``, which
    FastAPI passes through its body parsing to the app's error handlers (the OpenAI error body)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        received = 0

        async def limited() -> Message:
            nonlocal received
            if declared is not None and declared > self.max_bytes:
                raise self._too_large()
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> starlette.exceptions.HTTPException:
        return starlette.exceptions.HTTPException(
            413, detail=f"the request body exceeds {self.max_bytes} bytes", headers={"Connection": "close"}
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
