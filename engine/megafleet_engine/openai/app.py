"""The OpenAI-compatible app, wherever it runs: in the engine's process or in an API-server process.

Called by :class:`megafleet_engine.server.EngineServers` (frontend in the engine's process) and by
:mod:`megafleet_engine.api_server` (frontend in its own processes, the engine in the core).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fastapi

from megafleet_engine import metrics as metrics_module
from megafleet_engine.openai import errors, router, serving

__all__ = ["FRONTEND_PATHS", "build_frontend_app"]

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
    return app
