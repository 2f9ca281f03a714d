"""The OpenAI-compatible routes: thin functions from HTTP to :mod:`megafleet_engine.openai.serving`.

Mounted by :func:`megafleet_engine.server.build_frontend_app`, which stores a :class:`Frontend` in
``app.state.frontend``. Routes authorize (optional API key), call serving, and wrap the result in
a JSON or SSE response stamped with ``X-Megafleet-Weight-Version``. A non-streaming request whose
client disconnects is cancelled, which cancels its generation; streams are cancelled by the
server itself on disconnect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import fastapi
from fastapi import responses
from starlette import background

from megafleet_engine.openai import errors, protocol, serving

__all__ = ["CLIENT_CLOSED_REQUEST", "WEIGHT_VERSION_HEADER", "Frontend", "router", "weight_version_header"]

WEIGHT_VERSION_HEADER = "X-Megafleet-Weight-Version"
"""Response header with the weight version that produced the response (``none`` before any weights)."""
CLIENT_CLOSED_REQUEST = 499
"""Status recorded (never seen by anyone) for a request whose client went away (nginx's convention)."""

T = TypeVar("T")

_ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": errors.ErrorBody} for status in (400, 401, 404, 500, 503)}


@dataclasses.dataclass(frozen=True)
class Frontend:
    """What the routes need, built once per app."""

    models: serving.ModelServing
    completions: serving.CompletionServing
    chat: serving.ChatServing
    context: serving.ServingContext
    api_key: str | None = None


def weight_version_header(version: int | None) -> str:
    return "none" if version is None else str(version)


async def _frontend(request: fastapi.Request) -> Frontend:
    """The app's :class:`Frontend` (``async``: FastAPI runs a plain ``def`` dependency in a worker
    thread, two thread hops per request for nothing)."""
    return _frontend_of(request)


def _frontend_of(request: fastapi.Request) -> Frontend:
    frontend = request.app.state.frontend
    assert isinstance(frontend, Frontend)
    return frontend


async def _authorize(request: fastapi.Request) -> None:
    """With an API key configured, ``/v1/*`` needs ``Authorization: Bearer <key>``."""
    key = _frontend_of(request).api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise errors.Unauthorized("missing or wrong API key: send Authorization: Bearer <key>")


FrontendDep = Annotated[Frontend, fastapi.Depends(_frontend)]

router = fastapi.APIRouter(prefix="/v1", dependencies=[fastapi.Depends(_authorize)], responses=_ERRORS)


@router.get("/models")
async def list_models(frontend: FrontendDep) -> responses.JSONResponse:
    models = frontend.models.list_models()
    return _json(models, models.weight_version)


@router.get("/models/{model:path}")
async def get_model(model: str, frontend: FrontendDep) -> responses.JSONResponse:
    version = frontend.context.client.weight_version
    card = frontend.models.get_model(model)
    return responses.JSONResponse(
        {**protocol.dump(card), "weight_version": version},
        headers={WEIGHT_VERSION_HEADER: weight_version_header(version)},
    )


@router.post("/completions")
async def create_completion(
    body: protocol.CompletionRequest, request: fastapi.Request, frontend: FrontendDep
) -> responses.Response:
    if body.stream:
        return _sse(await frontend.completions.stream(body))
    result = await _cancel_on_disconnect(request, frontend.completions.create(body))
    return result if isinstance(result, responses.Response) else _json(result, result.weight_version)


@router.post("/chat/completions")
async def create_chat_completion(
    body: protocol.ChatCompletionRequest, request: fastapi.Request, frontend: FrontendDep
) -> responses.Response:
    return await _chat(body, request, frontend)


@router.post("/chat/completions/batch")
async def create_chat_completion_batch(
    body: protocol.ChatBatchRequest, request: fastapi.Request, frontend: FrontendDep
) -> responses.Response:
    """Extension: several conversations in one request (``messages`` is a list of conversations),
    answered as one chat completion whose choice ``i * n + k`` is conversation ``i``'s ``k``-th."""
    return await _chat(body, request, frontend)


async def _chat(body: protocol.ChatSamplingRequest, request: fastapi.Request, frontend: Frontend) -> responses.Response:
    if body.stream:
        return _sse(await frontend.chat.stream(body))
    result = await _cancel_on_disconnect(request, frontend.chat.create(body))
    return result if isinstance(result, responses.Response) else _json(result, result.weight_version)


def _json(body: protocol.OpenAIBaseModel, version: int | None) -> responses.JSONResponse:
    return responses.JSONResponse(protocol.dump(body), headers={WEIGHT_VERSION_HEADER: weight_version_header(version)})


def _sse(stream: serving.Stream) -> responses.StreamingResponse:
    return responses.StreamingResponse(
        stream.events,
        media_type="text/event-stream",
        headers={WEIGHT_VERSION_HEADER: weight_version_header(stream.weight_version), "Cache-Control": "no-cache"},
        background=background.BackgroundTask(_closer(stream)),  # closes the run even if never iterated
    )


def _closer(stream: serving.Stream) -> Callable[[], Awaitable[None]]:
    """``stream.close`` as a coroutine function: Starlette runs a plain function as a background
    task in a worker thread (a thread hop per streamed request)."""

    async def close() -> None:
        stream.close()

    return close


async def _cancel_on_disconnect(request: fastapi.Request, work: Awaitable[T]) -> T | responses.Response:
    """Await ``work`` unless the client disconnects first; then cancel it (and its generation)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        return responses.Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


async def _disconnected(request: fastapi.Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
