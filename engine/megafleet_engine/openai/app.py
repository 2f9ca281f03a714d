"""The OpenAI-compatible app, wherever it runs: in the engine's process or in an API-server process.

Called by :class:`megafleet_engine.server.EngineServers` (frontend in the engine's process) and by
:mod:`megafleet_engine.api_server` (frontend in its own processes, the engine in the core).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import fastapi
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from megafleet_engine import metrics as metrics_module
from megafleet_engine.openai import errors, router, serving

__all__ = ["FRONTEND_PATHS", "CloseWhileNotAccepting", "build_frontend_app"]

FRONTEND_PATHS = frozenset(
    {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/health"}
)
"""Endpoint label values of the request metrics; anything else counts as ``other``."""


def build_frontend_app(context: serving.ServingContext, *, api_key: str | None = None) -> fastapi.FastAPI:
    """The OpenAI-compatible app; ``GET /health`` (no key) says whether the engine takes requests.

    ``/health`` is the pod's readiness probe (period 2 s, failure threshold 1). It answers 200 while
    the engine is ``ready`` and also while it is suspended *for a refit* with holding on
    (``{"status": "refitting"}``): such a request waits at the gate and is served by the new
    version. Answering 503 there would make the kubelet drop the pod from its Service's endpoints
    at the first probe inside the refit and add it back only at the first probe after it (up to 2 s
    plus endpoint propagation later); every member of a refit suspends at the same moment, so the
    Service would have no endpoint at all and ClusterIP clients would fail to connect for a refit
    that otherwise loses nothing. A refit that fails leaves the engine ``stale``, which answers 503
    at the next probe; a plain suspend (fencing, draining before removal), ``loading`` and
    ``failed`` answer 503 as before."""
    app = fastapi.FastAPI(title="megafleet engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = router.Frontend(
        models=serving.ModelServing(context),
        completions=serving.CompletionServing(context),
        chat=serving.ChatServing(context),
        context=context,
        api_key=api_key,
    )

    def stamp() -> tuple[Mapping[str, Any], Mapping[str, str]]:
        version = context.client.weight_version
        return {"weight_version": version}, {router.WEIGHT_VERSION_HEADER: router.weight_version_header(version)}

    errors.install(app, stamp=stamp)
    app.include_router(router.router)

    @app.get("/health")
    async def health() -> dict[str, str]:
        # The pod's readiness probe. Suspended for a refit counts as serving: requests are held and
        # served by the new version, so the pod stays in its Service (see above).
        client = context.client
        if not client.accepting:
            raise errors.ServiceUnavailable(f"the engine is {client.state}", code=client.state)
        return {"status": "ready" if client.state == "ready" else "refitting"}

    app.add_middleware(metrics_module.RequestMetrics, metrics=context.metrics, known=FRONTEND_PATHS)
    app.add_middleware(CloseWhileNotAccepting, accepting=lambda: context.client.accepting)
    return app


class CloseWhileNotAccepting:
    """ASGI middleware: a response that starts while the engine does not accept requests (draining
    before its shard is removed, fenced, stale, loading) says ``Connection: close``, and the server
    closes the connection after it.

    Why: a shard being removed drains what it holds and then its server exits, closing every idle
    kept-alive connection. A client that sends its next request on such a connection just as it
    closes sees a reset (HTTP/1.1 keep-alive's race) for a request the engine never saw; the OpenAI
    client retries that, a client with retries off fails. Closing each connection once its response
    is done leaves a client of a draining shard no idle connection to race on: its next request opens
    a new one, which the draining server answers 503 and a gone one refuses; both are plainly not
    accepted. A refit's hold counts as accepting (its requests are served), so refits keep
    connections alive; a stream that started before the drain keeps its connection until the server
    exits."""

    def __init__(self, app: ASGIApp, *, accepting: Callable[[], bool]) -> None:
        self.app = app
        self._accepting = accepting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start" and not self._accepting():
                headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing)
