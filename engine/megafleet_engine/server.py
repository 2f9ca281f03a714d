"""The HTTP servers of one rank process: OpenAI frontend, agent API and metrics, in one event loop.

Called by :mod:`megafleet_engine.cli` for each rank process and by tests. :class:`EngineServers`
binds its sockets first (so the address the frontend really serves is known before any app is
built, and port 0 works) and then runs one uvicorn server per socket until :meth:`EngineServers.stop`,
each bounded as :mod:`megafleet_engine.http_server` says (the frontend's limits, or the agent's for
the agent and the metrics server).
Which servers a process runs is the caller's choice: frontend ranks serve the frontend, every rank
an agent (local rank 0's is the pod's and forwards refits to the others), local rank 0 the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import fastapi
import uvicorn

from megafleet_engine import agent_server, http_server
from megafleet_engine import engine as engine_module
from megafleet_engine import metrics as metrics_module
from megafleet_engine import siblings as siblings_module
from megafleet_engine.backends import base
from megafleet_engine.core_ipc import core as core_module
from megafleet_engine.openai import app as frontend_app
from megafleet_engine.openai import engine_client, errors, serving
from megafleet_protocol import http_limits

__all__ = ["EngineServers", "Listener", "bind", "build_agent_app", "build_frontend_app", "read_secret", "tokenizer_of"]

build_frontend_app = frontend_app.build_frontend_app

log = logging.getLogger(__name__)


def build_agent_app(agent: agent_server.AgentServer) -> fastapi.FastAPI:
    """The agent app (operator only)."""
    app = fastapi.FastAPI(title="megafleet engine agent", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.agent = agent
    errors.install(app)
    app.include_router(agent_server.health_router)
    app.include_router(agent_server.router)
    app.include_router(agent_server.refit_router)
    return app


def read_secret(path: Path, *, what: str) -> str:
    """A token from a mounted Secret file; missing or empty is a startup error naming the file."""
    try:
        secret = path.read_text().strip()
    except OSError as error:
        raise RuntimeError(f"cannot read the {what} file {path}: {error.strerror}") from None
    if not secret:
        raise RuntimeError(f"the {what} file {path} is empty")
    return secret


def tokenizer_of(backend: base.Backend) -> base.Tokenizer:
    """The backend's tokenizer (the frontend turns text into token ids and back)."""
    tokenizer = backend.tokenizer
    if tokenizer is None:
        raise RuntimeError(f"the {type(backend).__name__} backend has no tokenizer; the frontend needs one")
    return tokenizer


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port).

    Made with ``IPPROTO_TCP`` explicitly: asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only
    on connections whose socket says so, and an accepted connection inherits the listener's
    protocol number; with the default (0) every kept-alive response waited 40 ms
    (``docs/incidents.md#nagle-40ms``)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.set_inheritable(False)
    return sock


def address_of(sock: socket.socket) -> str:
    """``host:port`` (``[host]:port`` for IPv6) the socket is bound to."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass(frozen=True)
class Listener:
    """One server to run: its name (for logs), app and bound socket."""

    name: str
    app: fastapi.FastAPI
    sock: socket.socket
    address: str  # host:port the socket is bound to
    limits: http_limits.HttpLimits


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals alone: the process stops every server together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class EngineServers:
    """The servers of one rank process, on sockets bound before the apps are built.

    Args:
        engine: the rank's engine.
        tokenizer: its tokenizer.
        metrics: its metrics.
        host: address to bind (the pod IP).
        frontend_port: the frontend's port, or ``None`` on a rank that is not a frontend rank.
        agent_port: the agent's port, or ``None`` on a process that does not serve the agent.
        metrics_port: the metrics port, or ``None`` likewise.
        agent_token_file: the agent's token file (required with ``agent_port``).
        api_key: the frontend's API key, if any.
        rank: global rank of this process; world_size: ranks in the shard.
        siblings: the agents of the pod's other local ranks (on local rank 0 of a multi-rank pod).
        agent_host: where the agent binds, if not ``host`` (the other local ranks: the pod's
            loopback); its refit transports still bind ``host``.
        api_servers: API-server processes that serve the frontend (the engine core split,
            :mod:`megafleet_engine.core_ipc`); 0 serves it in this process's event loop.
        http: the bounds of the servers (:mod:`megafleet_engine.http_server`); default: the
            documented defaults.
    """

    def __init__(
        self,
        engine: engine_module.Engine,
        tokenizer: base.Tokenizer,
        metrics: metrics_module.Metrics,
        *,
        host: str,
        frontend_port: int | None,
        agent_port: int | None,
        metrics_port: int | None,
        agent_token_file: Path | None = None,
        api_key: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        siblings: siblings_module.Siblings | None = None,
        agent_host: str | None = None,
        api_servers: int = 0,
        http: http_limits.HttpBounds = http_limits.DEFAULTS,
    ) -> None:
        if agent_port is not None:
            if agent_token_file is None:
                raise RuntimeError("the agent needs a token file (MEGAFLEET_AGENT_TOKEN_FILE)")
            read_secret(agent_token_file, what="agent token")
        self.listeners: list[Listener] = []
        self._core: core_module.CoreServer | None = None
        self._frontend_sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self.served_address: str | None = None
            if frontend_port is not None and api_servers > 0:
                self._frontend_sock = bind(host, frontend_port)
                self.served_address = address_of(self._frontend_sock)
                self._core = core_module.CoreServer(
                    engine,
                    metrics,
                    tokenizer,
                    listener=self._frontend_sock,
                    count=api_servers,
                    api_key=api_key,
                    http=http.frontend,
                )
            elif frontend_port is not None:
                context = serving.ServingContext(engine_client.LocalClient(engine), tokenizer, metrics)
                app = build_frontend_app(context, api_key=api_key)
                self._listen("frontend", app, host, frontend_port, http.frontend)
                self.served_address = self.listeners[-1].address
            if agent_port is not None and agent_token_file is not None:
                agent = agent_server.AgentServer(
                    engine,
                    agent_token_file,
                    rank=rank,
                    world_size=world_size,
                    served_address=self.served_address,
                    metrics=metrics,
                    siblings=siblings,
                    transfer_address=host if agent_host not in (None, host) else None,
                )
                self._listen("agent", build_agent_app(agent), agent_host or host, agent_port, http.agent)
            if metrics_port is not None:
                self._listen("metrics", metrics_module.build_app(metrics), host, metrics_port, http.agent)
        except BaseException:
            self.close_sockets()
            raise
        self._servers = [
            _Server(http_server.config(listener.app, listener.limits, name=listener.name))
            for listener in self.listeners
        ]
        http_server.allow_open_files(sum(listener.limits.max_connections for listener in self.listeners))

    def _listen(self, name: str, app: fastapi.FastAPI, host: str, port: int, limits: http_limits.HttpLimits) -> None:
        sock = bind(host, port)
        self.listeners.append(Listener(name, app, sock, address_of(sock), limits))

    def address(self, name: str) -> str | None:
        """Where the server called ``name`` (frontend, agent, metrics) listens, if it runs."""
        if name == "frontend" and self._core is not None:
            return self.served_address
        return next((listener.address for listener in self.listeners if listener.name == name), None)

    @property
    def started(self) -> bool:
        return all(server.started for server in self._servers)

    async def serve(self) -> None:
        """Run every server until :meth:`stop` (or until one of them ends, which stops the rest)."""
        self._loop = asyncio.get_running_loop()
        names = [listener.name for listener in self.listeners]
        tasks = [
            asyncio.create_task(server.serve(sockets=[listener.sock]), name=f"megafleet-{listener.name}")
            for server, listener in zip(self._servers, self.listeners, strict=True)
        ]
        if self._core is not None:
            names.append("frontend")
            tasks.append(asyncio.create_task(self._core.serve(), name="megafleet-core"))
            log.info(
                "serving the frontend on http://%s (%d API-server processes)", self.served_address, self._core.count
            )
        for listener in self.listeners:
            log.info("serving the %s on http://%s", listener.name, listener.address)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.stop()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            self.close_sockets()
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                raise RuntimeError(f"the {name} server failed: {result!r}") from result
        for name in names:
            log.info("stopped the %s on http://%s", name, self.address(name))

    def stop(self) -> None:
        """Ask every server to finish its responses in flight and stop (safe from any thread)."""
        for server in self._servers:
            server.should_exit = True
        if self._core is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the core stopped already
                self._loop.call_soon_threadsafe(self._core.stop)

    def close_sockets(self) -> None:
        for listener in self.listeners:
            listener.sock.close()
        if self._frontend_sock is not None:
            self._frontend_sock.close()
