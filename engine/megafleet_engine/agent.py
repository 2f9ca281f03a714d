"""The pod-local agent API: what the operator calls on each engine pod (never clients).

Mounted on the agent port by :func:`megafleet_engine.server.build_agent_app`, which stores an
:class:`Agent` in ``app.state.agent``. Every route except ``GET /healthz`` needs
``Authorization: Bearer <agent token>``; the token is read from its file (a mounted Secret) on every
call, so a rotated Secret takes effect without a restart. ``/healthz`` is unauthenticated on
purpose: it is the kubelet's liveness probe, which cannot carry the Secret, and it says nothing
beyond "the process answers".

Routes: ``GET /healthz``, ``GET /readyz``, ``GET /v1/state``, ``POST /v1/suspend``,
``POST /v1/resume``, and ``POST /v1/refit/...`` (501 until the refit receiver fills
:data:`refit_router` in). Bodies use camelCase like the Kubernetes API the operator speaks.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import fastapi
import pydantic
from fastapi import responses
from pydantic import Field
from pydantic.alias_generators import to_camel

from megafleet_engine import engine as engine_module
from megafleet_engine import metrics as metrics_module
from megafleet_engine.openai import errors

__all__ = ["Agent", "ResumeRequest", "StateResponse", "SuspendRequest", "health_router", "refit_router", "router"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Agent:
    """What the agent routes need: the engine, this rank's identity and the token file."""

    engine: engine_module.Engine
    token_file: Path
    rank: int = 0
    world_size: int = 1
    served_address: str | None = None  # host:port the frontend bound; None when not a frontend rank
    metrics: metrics_module.Metrics | None = None  # the refit routes record refit durations here


class _Body(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class SuspendRequest(_Body):
    mode: engine_module.SuspendMode = Field(
        default="drain", description="drain waits for requests in flight; abort ends them."
    )
    timeout_seconds: int = Field(default=60, ge=1, le=86400, description="how long a drain may take, in seconds.")


class ResumeRequest(_Body):
    weight_version: int | None = Field(default=None, ge=0, description="the version now served; unchanged if unset.")


class StateResponse(_Body):
    state: Literal["loading", "ready", "suspended", "stale", "failed"]
    weight_version: int | None
    served_address: str | None
    rank: int
    world_size: int
    last_error: str | None
    queue_depth: int


def _agent(request: fastapi.Request) -> Agent:
    agent = request.app.state.agent
    assert isinstance(agent, Agent)
    return agent


def _authorize(request: fastapi.Request) -> None:
    expected = read_token(_agent(request).token_file)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise errors.Unauthorized("missing or wrong agent token", code="invalid_token")


def read_token(path: Path) -> str:
    """The token in ``path``, stripped. Unreadable or empty refuses every call (never "no auth")."""
    try:
        token = path.read_text().strip()
    except OSError as error:
        log.error("cannot read the agent token file %s: %s", path, error)
        raise errors.Unauthorized("the agent token is unavailable on this pod", code="invalid_token") from None
    if not token:
        raise errors.Unauthorized("the agent token file is empty on this pod", code="invalid_token")
    return token


AgentDep = Annotated[Agent, fastapi.Depends(_agent)]
_ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": errors.ErrorBody} for status in (401, 409, 500, 504)}

health_router = fastapi.APIRouter()
router = fastapi.APIRouter(dependencies=[fastapi.Depends(_authorize)], responses=_ERRORS)
refit_router = fastapi.APIRouter(prefix="/v1/refit", dependencies=[fastapi.Depends(_authorize)], responses=_ERRORS)


@health_router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(agent: AgentDep) -> dict[str, str]:
    state = agent.engine.state
    if state != "ready":
        raise errors.ServiceUnavailable(f"the engine is {state}", code=state)
    return {"status": "ready"}


@router.get("/v1/state")
async def get_state(agent: AgentDep) -> responses.JSONResponse:
    return _state(agent)


@router.post("/v1/suspend")
async def suspend(body: SuspendRequest, agent: AgentDep) -> responses.JSONResponse:
    try:
        await agent.engine.suspend(body.mode, timeout_seconds=body.timeout_seconds)
    except TimeoutError as error:
        raise errors.GatewayTimeout(f"suspend ({body.mode}) did not finish: {error}") from None
    return _state(agent)


@router.post("/v1/resume")
async def resume(body: ResumeRequest, agent: AgentDep) -> responses.JSONResponse:
    try:
        agent.engine.resume(weight_version=body.weight_version)
    except engine_module.EngineError as error:
        raise errors.Conflict(str(error), code="no_weights") from None
    return _state(agent)


@refit_router.post("/{operation:path}", status_code=501)
async def refit(operation: str) -> None:
    raise errors.NotImplementedYet(f"refit ({operation}) is not implemented in this engine yet")


def _state(agent: Agent) -> responses.JSONResponse:
    engine = agent.engine
    body = StateResponse(
        state=engine.state,
        weight_version=engine.weight_version,
        served_address=agent.served_address,
        rank=agent.rank,
        world_size=agent.world_size,
        last_error=engine.last_error,
        queue_depth=engine.queue_depth,
    )
    return responses.JSONResponse(body.model_dump(mode="json", by_alias=True))
