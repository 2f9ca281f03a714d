"""The engine's HTTP errors and their one mapping to the OpenAI error envelope.

Serving code (:mod:`megafleet_engine.openai.serving`, :mod:`megafleet_engine.agent_server`) *raises* these;
:func:`install` registers the exception handlers that turn them, FastAPI's validation errors, unknown
routes and anything unexpected into ``{"error": {"message", "type", "param", "code"}}`` with the
right status. Streams that fail after their first byte use :func:`envelope` for the SSE error chunk.

Exception tree::

    HTTPError                      status  type                    code
    ├── InvalidRequest             400     invalid_request_error   (per raise; None by default)
    │   └── ContextLengthExceeded  400     invalid_request_error   context_length_exceeded
    ├── Unauthorized               401     authentication_error    invalid_api_key | invalid_token
    ├── NotFound                   404     not_found_error         not_found
    │   └── ModelNotFound          404     not_found_error         model_not_found
    ├── Conflict                   409     conflict_error          (per raise)
    ├── InternalError              500     internal_error          internal_error
    ├── NotImplementedYet          501     not_implemented_error   not_implemented
    ├── ServiceUnavailable         503     service_unavailable     engine state, or aborted; + Retry-After
    └── GatewayTimeout             504     timeout_error           timeout
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import fastapi
import fastapi.exceptions
import pydantic
import starlette.exceptions
from fastapi import responses

__all__ = [
    "RETRY_AFTER_SECONDS",
    "Conflict",
    "ContextLengthExceeded",
    "ErrorBody",
    "GatewayTimeout",
    "HTTPError",
    "InternalError",
    "InvalidRequest",
    "ModelNotFound",
    "NotFound",
    "NotImplementedYet",
    "ServiceUnavailable",
    "Unauthorized",
    "envelope",
    "install",
]

RETRY_AFTER_SECONDS = 5
"""``Retry-After`` on 503, in seconds: a suspend for refit usually lasts a few seconds; loading longer,
but clients poll anyway."""


class HTTPError(Exception):
    """Base of every error an HTTP caller sees; subclasses fix the status and OpenAI error type."""

    status: int = 500
    type: str = "internal_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self._headers = dict(headers or {})

    def headers(self) -> dict[str, str]:
        """Extra response headers this error needs."""
        return dict(self._headers)


class InvalidRequest(HTTPError):
    """The request is malformed or asks for something this engine cannot do."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus completion would not fit in the model's maximum sequence length."""

    default_code = "context_length_exceeded"


class Unauthorized(HTTPError):
    """Missing or wrong bearer token or API key."""

    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class NotFound(HTTPError):
    """No such route."""

    status = 404
    type = "not_found_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    """The request names a model this engine does not serve."""

    default_code = "model_not_found"


class Conflict(HTTPError):
    """The call does not fit the engine's current state (e.g. resume before any weights)."""

    status = 409
    type = "conflict_error"


class InternalError(HTTPError):
    """Something failed inside the engine; the message says what, without internals."""

    status = 500
    type = "internal_error"
    default_code = "internal_error"


class NotImplementedYet(HTTPError):
    """A route that exists for its shape but whose behaviour is not implemented yet."""

    status = 501
    type = "not_implemented_error"
    default_code = "not_implemented"


class ServiceUnavailable(HTTPError):
    """The engine does not accept requests now (loading, suspended, stale, failed) or aborted one."""

    status = 503
    type = "service_unavailable"

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Retry-After": str(RETRY_AFTER_SECONDS)}


class GatewayTimeout(HTTPError):
    """An operation did not finish within the time the caller allowed."""

    status = 504
    type = "timeout_error"
    default_code = "timeout"


class ErrorDetail(pydantic.BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(pydantic.BaseModel):
    """The envelope every error body has; routes declare it in ``responses=`` for the API docs."""

    error: ErrorDetail


def envelope(error: HTTPError) -> dict[str, Any]:
    """The OpenAI error body for ``error``."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


Stamp = Callable[[], tuple[Mapping[str, Any], Mapping[str, str]]]
"""Extra top-level body fields and headers for every error response (the frontend's weight version)."""


def install(app: fastapi.FastAPI, *, stamp: Stamp | None = None) -> None:
    """Register the handlers that map every error of ``app`` to the envelope.

    Unexpected exceptions become a 500 envelope; Starlette then re-raises them, so the server logs
    them once with their traceback (this module does not log them again).
    """

    def respond(error: HTTPError) -> responses.JSONResponse:
        body = envelope(error)
        headers = error.headers()
        if stamp is not None:
            extra_body, extra_headers = stamp()
            body.update(extra_body)
            headers.update(extra_headers)
        return responses.JSONResponse(body, status_code=error.status, headers=headers)

    async def on_http_error(request: fastapi.Request, exc: Exception) -> responses.JSONResponse:
        assert isinstance(exc, HTTPError)
        return respond(exc)

    async def on_validation_error(request: fastapi.Request, exc: Exception) -> responses.JSONResponse:
        assert isinstance(exc, fastapi.exceptions.RequestValidationError)
        return respond(from_validation(exc))

    async def on_starlette_error(request: fastapi.Request, exc: Exception) -> responses.JSONResponse:
        assert isinstance(exc, starlette.exceptions.HTTPException)
        return respond(from_starlette(exc, request))

    async def on_unexpected(request: fastapi.Request, exc: Exception) -> responses.JSONResponse:
        return respond(InternalError(f"internal error ({type(exc).__name__})"))

    app.add_exception_handler(HTTPError, on_http_error)
    app.add_exception_handler(fastapi.exceptions.RequestValidationError, on_validation_error)
    app.add_exception_handler(starlette.exceptions.HTTPException, on_starlette_error)
    app.add_exception_handler(Exception, on_unexpected)


def from_validation(exc: fastapi.exceptions.RequestValidationError) -> InvalidRequest:
    """FastAPI's request validation failure (bad JSON, wrong types, bad values) as a 400."""
    problems = list(exc.errors())
    if not problems:
        return InvalidRequest("invalid request")
    first = problems[0]
    if first.get("type") == "json_invalid":
        return InvalidRequest(f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}")
    params = [_param(problem) for problem in problems]
    param = params[0]
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if len(problems) > 1 and all(other == param for other in params):
        message = f"no accepted form matches ({message}, and {len(problems) - 1} more)"
    elif len(problems) > 1:
        message += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    if param is not None:
        message = f"{param}: {message}"
    return InvalidRequest(message, param=param)


def _param(problem: Mapping[str, Any]) -> str | None:
    """The dotted field path of one validation problem, without "body" and union branch names; a
    whole-body check names the field in its context's ``param``."""
    param = (problem.get("ctx") or {}).get("param")
    if isinstance(param, str):
        return param
    loc = [str(part) for part in problem.get("loc", ()) if part != "body"]
    return ".".join(part for part in loc if not _is_union_branch(part)) or None


def from_starlette(exc: starlette.exceptions.HTTPException, request: fastapi.Request) -> HTTPError:
    """Routing errors (unknown route, wrong method) and other framework errors (a body over the
    server's limit: 413, :class:`megafleet_engine.http_server.BodyLimit`) as typed errors, with their
    headers."""
    if exc.status_code == 404:
        return NotFound(f"no route {request.method} {request.url.path}")
    error = HTTPError(str(exc.detail), headers=exc.headers)
    error.status = exc.status_code
    error.type = "invalid_request_error" if 400 <= exc.status_code < 500 else "internal_error"
    error.code = None
    return error


def _is_union_branch(part: str) -> bool:
    return part in {"str", "int", "float", "bool"} or part.startswith(("list[", "dict[", "function-"))
