"""The pod-local agent API: what the operator calls on each engine pod (never clients).

Mounted on the agent port by :func:`megafleet_engine.server.build_agent_app`, which stores an
:class:`AgentServer` in ``app.state.agent``. Every route except ``GET /healthz`` needs
``Authorization: Bearer <agent token>``; the token is read from its file (a mounted Secret) on every
call, so a rotated Secret takes effect without a restart. ``/healthz`` is unauthenticated on
purpose: it is the kubelet's liveness probe, which cannot carry the Secret, and it says nothing
beyond "the process answers".

Routes: ``GET /healthz``, ``GET /readyz``, ``GET /v1/state``, ``POST /v1/suspend``,
``POST /v1/resume``, and the refit routes (:data:`refit_router`, carried out by
:mod:`megafleet_engine.refit_attempts`). The bodies are :mod:`megafleet_protocol.agent_api`'s models:

* ``POST /v1/refit/prepare`` (202): receive weight version ``version`` from the trainer's world at
  ``rendezvous`` (address, port, worldSize, rankOffset = the shard's offset, trainerWorldSize) with
  ``transport``, ``bucketSizeMiB``, ``timeoutSeconds``, ``suspendMode`` (drain, abort, or keep: the
  sequences in flight go on across the switch, their KV as ``kvCacheMode`` says), ``kvCacheMode`` and
  ``staging`` (receive into the engine's staging copy while it serves). Returns at once; the attempt
  suspends or pauses the engine (or, staged, leaves it serving), joins as rank ``rankOffset + rank``,
  receives, writes and serves the new version, on its own thread.
* ``POST /v1/refit/checkpoint`` (202): the same from a checkpoint ``path`` every shard reads itself.
* ``POST /v1/refit/nemo`` (202): the same from an unmodified NeMo RL trainer's own collective
  (``rendezvous`` as ``init_collective`` got it, ``refitInfo`` as ``prepare_refit_info`` gave it, the
  trainer's ``bucketBytes``); the first one joins NeMo's world as rank ``rankOffset + rank``, later
  ones over the same world keep that membership (``reused``). A refit info that does not fit this
  engine is refused (400) before anything is suspended.
* ``POST /v1/refit/nemo/join`` (202): join NeMo's world for a RefitSession at the trainer's
  ``init_collective`` time, on a thread, without suspending; ``POST /v1/refit/nemo/leave`` (200,
  idempotent): drop that membership (a refit running over it fails). While joined, each rank probes
  the trainer's store every 10 s (``world.storeReachable`` in the status).
* ``POST /v1/refit/nemo/reshard/join`` and ``/v1/refit/nemo/reshard`` (202): NeMo's M-to-N reshard beside a
  joined world: join every pipeline stage's communicator, then refits (:mod:`.refit_attempts.sources.nemo_reshard`).
* ``POST /v1/refit/megatron/join`` (202), ``POST /v1/refit/megatron`` (202) and
  ``POST /v1/refit/megatron/leave``: megatron-core's own refit from a megatron-core trainer
  (:mod:`megafleet_engine.refit_attempts.megatron_group`): join its refit group at the store at
  ``port + 1`` and prepare the plan without suspending, then one ``swap_model_weights`` per refit of the
  session; 409 ``backend_cannot_swap`` on a backend without a megatron-core model (or megatron-core
  < 0.17), 409 ``megatron_not_joined`` for a refit without a joined group.
* ``GET /v1/refit/status``: the current or last attempt: ``phase`` (idle, suspending, pausing, joining,
  receiving, staging, applying, staged, switching, resuming, succeeded, failed), per-phase
  milliseconds, counters, ``error``, ``reused`` (the join kept the transfer group parked by the
  previous refit), ``inFlight`` (requested and effective mode, why they differ, what was kept,
  drained, aborted, recomputed), ``staging`` and ``pause`` (stall, gate closed, switch, recompute).
* ``POST /v1/refit/abort``: fail the running attempt now, as its watchdog would at the deadline,
  and close a parked transfer group (a staged copy is discarded, a paused engine released).
* ``POST /v1/refit/commit``: the operator's commit (``commit: operator``): the attempt staged for
  ``version`` switches; idempotent (a rank that serves it answers 200), 409 ``not_staged`` where no
  attempt waits for it. A staged attempt under ``commit: trainer`` or ``operator`` reports ``staged``
  and waits for its commit until its deadline plus ``commitGraceSeconds``, then discards its copy
  and fails (nothing switched); an attempt that receives in place cannot wait and switches as
  ``commit: local`` does (its ``commit`` report says so).
* ``POST /v1/refit/peer`` (202) and ``POST /v1/peer/send`` (202, ``GET /v1/peer/status``): catch up
  from a live shard of the fleet: the peer sends its live weights while it serves
  (:mod:`megafleet_engine.peer_sends`), each rank of the catching-up shard receives from the peer's rank
  of the same number (:mod:`megafleet_engine.refit_attempts.sources.peer`).

On a pod with several local ranks, local rank 0's agent forwards the refit calls to the others
(:mod:`megafleet_engine.siblings`) and answers with one status for the pod: failed when any rank
failed, succeeded when all did.

A failed attempt leaves the engine ``stale`` (no request is served: never a mix of two versions),
unless it staged and nothing of the new version went live (the old version serves on); once it wrote
any live weight, ``POST /v1/resume`` is refused and only a complete refit brings it back.
``GET /v1/state`` reports the engine's ``capabilities`` (the KV-cache modes it keeps sequences under,
its staging copy's size or why it has none).
Repeating a prepare, checkpoint or nemo call that runs or succeeded answers its status; another refit
while one runs is a 409. Bodies use camelCase like the Kubernetes API the operator speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import logging
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import fastapi
import pydantic
from fastapi import responses

from megafleet_engine import engine as engine_module
from megafleet_engine import metrics as metrics_module
from megafleet_engine import peer_sends
from megafleet_engine import siblings as siblings_module
from megafleet_engine.openai import errors
from megafleet_engine.refit_attempts import controller as refit_controller
from megafleet_engine.refit_attempts import megatron_group, reports, reshard_stages, sources
from megafleet_engine.refit_attempts import phases as refit_phases
from megafleet_engine.refit_attempts.sources import checkpoint, nemo_collective, nemo_reshard
from megafleet_engine.refit_attempts.sources import peer as peer_source
from megafleet_engine.refit_attempts.sources import rendezvous as rendezvous_source
from megafleet_protocol import agent_api, vocabulary

__all__ = [
    "AgentServer",
    "health_router",
    "refit_router",
    "router",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentServer:
    """What the agent routes need: the engine, this rank's identity and the token file."""

    engine: engine_module.Engine
    token_file: Path
    rank: int = 0
    world_size: int = 1
    served_address: str | None = None  # host:port the frontend bound; None when not a frontend rank
    metrics: metrics_module.Metrics | None = None  # the refit routes record refit durations here
    siblings: siblings_module.Siblings | None = None  # the pod's other local ranks (local rank 0 only)
    transfer_address: str | None = None  # where refit transports bind; None: the address this agent serves on
    refits: refit_controller.RefitController = dataclasses.field(init=False, repr=False, compare=False)
    megatron: megatron_group.NativeRefits = dataclasses.field(init=False, repr=False, compare=False)
    peers: peer_sends.PeerSends = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        controller = refit_controller.RefitController(self.engine, rank=self.rank, metrics=self.metrics)
        object.__setattr__(self, "refits", controller)
        object.__setattr__(self, "megatron", megatron_group.NativeRefits(controller))
        object.__setattr__(self, "peers", peer_sends.PeerSends(self.engine, controller, self.rank))


def _agent(request: fastapi.Request) -> AgentServer:
    agent = request.app.state.agent
    assert isinstance(agent, AgentServer)
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


class _TokenFirst(fastapi.routing.APIRoute):
    """A route that checks the agent token before FastAPI reads the body: a caller without the token
    learns nothing from a 400 about what it sent, only a 401."""

    def get_route_handler(self) -> Callable[[fastapi.Request], Coroutine[Any, Any, responses.Response]]:
        handler = super().get_route_handler()

        async def authorized(request: fastapi.Request) -> responses.Response:
            _authorize(request)
            return await handler(request)

        return authorized


AgentDep = Annotated[AgentServer, fastapi.Depends(_agent)]
_ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": errors.ErrorBody} for status in (401, 409, 500, 504)}

health_router = fastapi.APIRouter()
router = fastapi.APIRouter(route_class=_TokenFirst, responses=_ERRORS)
refit_router = fastapi.APIRouter(prefix=agent_api.REFIT, route_class=_TokenFirst, responses=_ERRORS)


@health_router.get(agent_api.HEALTHZ)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(agent_api.READYZ)
async def readyz(agent: AgentDep) -> dict[str, str]:
    state = agent.engine.state
    if state != "ready":
        raise errors.ServiceUnavailable(f"the engine is {state}", code=state)
    return {"status": "ready"}


@router.get(agent_api.STATE)
async def get_state(agent: AgentDep) -> responses.JSONResponse:
    return _state(agent)


@router.post(agent_api.SUSPEND)
async def suspend(body: agent_api.SuspendRequest, agent: AgentDep) -> responses.JSONResponse:
    try:
        await agent.engine.suspend(body.mode, timeout_seconds=body.timeout_seconds)
    except TimeoutError as error:
        raise errors.GatewayTimeout(f"suspend ({body.mode}) did not finish: {error}") from None
    return _state(agent)


@router.post(agent_api.RESUME)
async def resume(body: agent_api.ResumeRequest, agent: AgentDep) -> responses.JSONResponse:
    if agent.refits.running:
        raise errors.Conflict("a refit is in progress; it resumes the engine itself", code="refit_in_progress")
    if agent.refits.dirty:
        raise errors.Conflict(
            "a failed refit wrote part of a weight version; only a complete refit can bring this engine back",
            code="weights_incomplete",
        )
    try:
        agent.engine.resume(weight_version=body.weight_version)
    except engine_module.EngineError as error:
        raise errors.Conflict(str(error), code="no_weights") from None
    return _state(agent)


class _TrainerWorld(TypedDict):
    address: str
    port: int
    world_size: int
    rank_offset: int
    trainer_world_size: int


def _trainer_world(rendezvous: agent_api.RendezvousBody) -> _TrainerWorld:
    """The rendezvous fields every refit and join request of the controller takes, by their names."""
    return _TrainerWorld(
        address=rendezvous.address,
        port=rendezvous.port,
        world_size=rendezvous.world_size,
        rank_offset=rendezvous.rank_offset,
        trainer_world_size=rendezvous.trainer_world_size,
    )


@refit_router.post("/prepare", status_code=202)
async def refit_prepare(
    body: agent_api.PrepareRequest, request: fastapi.Request, agent: AgentDep
) -> responses.JSONResponse:
    rendezvous = body.rendezvous
    refit = rendezvous_source.RendezvousRequest(
        version=body.version,
        **_trainer_world(rendezvous),
        transport=body.transport,
        bucket_size_mib=body.bucket_size_mib,
        timeout_seconds=body.timeout_seconds,
        suspend_mode=_in_flight(body, verifies=True),
        kv_cache_mode=body.kv_cache_mode,
        staging=body.staging,
        local_address=agent.transfer_address or _pod_address(request),
        integrity=body.integrity,
        collective=body.collective,
        **_commit(body, trainer=True),
    )
    return await _start_refit(agent, refit, agent_api.REFIT_PREPARE, body)


@refit_router.post("/checkpoint", status_code=202)
async def refit_checkpoint(body: agent_api.CheckpointRefitRequest, agent: AgentDep) -> responses.JSONResponse:
    refit = checkpoint.CheckpointRequest(
        version=body.version,
        path=body.path,
        timeout_seconds=body.timeout_seconds,
        suspend_mode=_in_flight(body, verifies=True),
        kv_cache_mode=body.kv_cache_mode,
        staging=body.staging,
        integrity=body.integrity,
        **_commit(body),
    )
    return await _start_refit(agent, refit, agent_api.REFIT_CHECKPOINT, body)


@refit_router.post("/nemo/join", status_code=202)
async def refit_nemo_join(
    body: agent_api.NemoJoinRequest, request: fastapi.Request, agent: AgentDep
) -> responses.JSONResponse:
    rendezvous = body.rendezvous
    join = nemo_collective.NemoJoinRequest(
        session=body.session,
        **_trainer_world(rendezvous),
        generation=body.generation,
        timeout_seconds=body.timeout_seconds,
        local_address=agent.transfer_address or _pod_address(request),
    )
    with _refusals():
        own = reports.world_body(agent.refits.join(join))
    others = await _forward(agent, agent_api.REFIT_NEMO_JOIN, body)
    combined = own if others is None else siblings_module.combine_world([own, *others])
    return responses.JSONResponse(combined, status_code=202)


@refit_router.post("/nemo/leave")
async def refit_nemo_leave(body: agent_api.NemoLeaveRequest, agent: AgentDep) -> responses.JSONResponse:
    """Leave ``session``'s world on every rank of the pod (idempotent; a rank that cannot be reached
    holds nothing worth leaving)."""
    own = reports.world_body(agent.refits.leave(body.session))
    if agent.siblings is None:
        return responses.JSONResponse(own)
    try:
        others = await agent.siblings.post(agent_api.REFIT_NEMO_LEAVE, body.model_dump(mode="json", by_alias=True))
    except siblings_module.SiblingError as error:
        log.warning("forwarding the leave of session %r: %s", body.session, error)
        return responses.JSONResponse(own)
    return responses.JSONResponse(siblings_module.combine_world([own, *others]))


@refit_router.post("/nemo", status_code=202)
async def refit_nemo(
    body: agent_api.NemoRefitRequest, request: fastapi.Request, agent: AgentDep
) -> responses.JSONResponse:
    rendezvous = body.rendezvous
    info = tuple((tensor.name, tuple(tensor.shape), tensor.dtype) for tensor in body.refit_info)
    if rendezvous is None:  # the session form: over the world joined by /nemo/join, never joining
        with _refusals():  # 409 nemo_not_joined
            joined = agent.refits.joined(body.session)
        session_refit = joined.refit(
            version=body.version,
            refit_info=info,
            bucket_bytes=body.bucket_bytes,
            timeout_seconds=body.timeout_seconds,
            suspend_mode=_in_flight(body, verifies=True),
            kv_cache_mode=body.kv_cache_mode,
            staging=body.staging,
        )
        session_refit = dataclasses.replace(session_refit, integrity=body.integrity, **_commit(body))
        return await _start_refit(agent, session_refit, agent_api.REFIT_NEMO, body)
    refit = nemo_collective.NemoRequest(
        version=body.version,
        **_trainer_world(rendezvous),
        refit_info=info,
        bucket_bytes=body.bucket_bytes,
        generation=body.generation,
        timeout_seconds=body.timeout_seconds,
        suspend_mode=_in_flight(body, verifies=True),
        kv_cache_mode=body.kv_cache_mode,
        staging=body.staging,
        local_address=agent.transfer_address or _pod_address(request),
        integrity=body.integrity,
        **_commit(body),
    )
    return await _start_refit(agent, refit, agent_api.REFIT_NEMO, body)


@refit_router.post("/nemo/reshard/join", status_code=202)
async def refit_nemo_reshard_join(
    body: agent_api.NemoReshardJoinRequest, request: fastapi.Request, agent: AgentDep
) -> responses.JSONResponse:
    join = reshard_stages.StageJoinRequest.of(body, agent.transfer_address or _pod_address(request))
    with _refusals():
        own = reports.world_body(agent.refits.join_stages(join))
    others = await _forward(agent, agent_api.REFIT_NEMO_RESHARD_JOIN, body)
    combined = own if others is None else siblings_module.combine_world([own, *others])
    return responses.JSONResponse(combined, status_code=202)


@refit_router.post("/nemo/reshard", status_code=202)
async def refit_nemo_reshard(body: agent_api.NemoReshardRefitRequest, agent: AgentDep) -> responses.JSONResponse:
    with _refusals():
        joined, stages = agent.refits.joined(body.session), agent.refits.stages(body.session)
        refit = nemo_reshard.ReshardRequest.of(body, joined, stages, _in_flight(body), **_commit(body))
    return await _start_refit(agent, refit, agent_api.REFIT_NEMO_RESHARD, body)


@refit_router.get("/status")
async def refit_status(agent: AgentDep) -> responses.JSONResponse:
    own = _refit_status_body(agent, agent.refits.snapshot())
    if agent.siblings is None:
        return responses.JSONResponse(own)
    try:
        others = await agent.siblings.get(agent_api.REFIT_STATUS)
    except siblings_module.SiblingError as error:
        own.update(phase="failed", error=str(error))  # a rank that cannot answer cannot take part either
        return responses.JSONResponse(own)
    return responses.JSONResponse(siblings_module.combine(own, others))


@refit_router.post("/abort")
async def refit_abort(body: agent_api.RefitAbortRequest, agent: AgentDep) -> responses.JSONResponse:
    own = _refit_status_body(agent, agent.refits.abort(body.reason))
    if agent.siblings is None:
        return responses.JSONResponse(own)
    try:
        others = await agent.siblings.post(agent_api.REFIT_ABORT, body.model_dump(mode="json", by_alias=True))
    except siblings_module.SiblingError as error:  # an unreachable rank has nothing left to abort
        log.warning("forwarding the refit abort: %s", error)
        return responses.JSONResponse(own)
    return responses.JSONResponse(siblings_module.combine(own, others))


@refit_router.post("/commit")
async def refit_commit(body: agent_api.RefitCommitRequest, agent: AgentDep) -> responses.JSONResponse:
    """The operator's commit: the attempt staged for ``version`` switches, on every rank of the pod
    (idempotent: a rank that already serves it answers its status; 409 ``not_staged`` otherwise)."""
    try:
        snapshot = agent.refits.commit(body.version)
    except refit_controller.NotStaged as error:
        raise errors.Conflict(str(error), code="not_staged") from None
    own = _refit_status_body(agent, snapshot)
    others = await _forward(agent, agent_api.REFIT_COMMIT, body, abort=False)
    return responses.JSONResponse(own if others is None else siblings_module.combine(own, others))


@refit_router.post("/megatron/join", status_code=202)
async def refit_megatron_join(body: agent_api.MegatronJoinRequest, agent: AgentDep) -> responses.JSONResponse:
    rendezvous = body.rendezvous
    join = megatron_group.JoinRequest(
        session=body.session,
        **_trainer_world(rendezvous),
        copy_backend=body.copy_backend,
        timeout_seconds=body.timeout_seconds,
    )
    with _megatron_refusals():
        own = reports.world_body(agent.megatron.join(join, asyncio.get_running_loop()), protocol="megatron")
    others = await _forward(agent, agent_api.REFIT_MEGATRON_JOIN, body)
    combined = own if others is None else siblings_module.combine_world([own, *others])
    return responses.JSONResponse(combined, status_code=202)


@refit_router.post("/megatron", status_code=202)
async def refit_megatron(body: agent_api.MegatronRefitRequest, agent: AgentDep) -> responses.JSONResponse:
    if body.commit != "local":
        raise errors.Conflict(
            "megatron-core's swap writes the live model: it cannot stage, so it cannot wait for a commit",
            code="refit_mode_unsupported",
        )
    refit = megatron_group.RefitRequest(
        version=body.version,
        session=body.session,
        timeout_seconds=body.timeout_seconds,
        suspend_mode=_in_flight(body, verifies=True),
        kv_cache_mode=body.kv_cache_mode,
        staging=body.staging,
        integrity=body.integrity,
    )
    with _megatron_refusals():
        snapshot = agent.megatron.refit(refit, asyncio.get_running_loop())
    own = _refit_status_body(agent, snapshot)
    others = await _forward(agent, agent_api.REFIT_MEGATRON, body)
    return responses.JSONResponse(own if others is None else siblings_module.combine(own, others), status_code=202)


@refit_router.post("/megatron/leave")
async def refit_megatron_leave(body: agent_api.NemoLeaveRequest, agent: AgentDep) -> responses.JSONResponse:
    left = agent.megatron.leave(body.session)
    own = None if left is None else reports.world_body(left, protocol="megatron")
    others = await _forward(agent, agent_api.REFIT_MEGATRON_LEAVE, body)
    return responses.JSONResponse({"world": own if others is None else siblings_module.combine_world([own, *others])})


@contextlib.contextmanager
def _megatron_refusals() -> Iterator[None]:
    """The megatron-native refusals (409 ``backend_cannot_swap``, ``megatron_not_joined``), then the others."""
    with _refusals():
        try:
            yield
        except megatron_group.CannotSwap as error:
            raise errors.Conflict(str(error), code="backend_cannot_swap") from None
        except megatron_group.NotJoined as error:
            raise errors.Conflict(str(error), code="megatron_not_joined") from None


# -- catch-up from a peer: this engine sends (/v1/peer/send), or a catching-up one receives (/v1/refit/peer)


@router.post(agent_api.PEER_SEND, status_code=202)
async def peer_send(
    body: agent_api.PeerSendRequest, request: fastapi.Request, agent: AgentDep
) -> responses.JSONResponse:
    own = agent.peers.start(peer_sends.PeerSendRequest.of(body, agent.transfer_address or _pod_address(request)))
    others = await peer_sends.forward(agent.peers, agent.siblings, body)
    return responses.JSONResponse(peer_sends.status_body([own, *others]), status_code=202)


@router.get(agent_api.PEER_STATUS)
async def peer_status(agent: AgentDep) -> responses.JSONResponse:
    return responses.JSONResponse(peer_sends.status_body([agent.peers.snapshot()]))


@refit_router.post("/peer", status_code=202)
async def refit_peer(
    body: agent_api.PeerRefitRequest, request: fastapi.Request, agent: AgentDep
) -> responses.JSONResponse:
    local_address = agent.transfer_address or _pod_address(request)
    refit = peer_source.PeerRequest.of(body, _in_flight(body, verifies=True), local_address=local_address)
    return await _start_refit(agent, refit, agent_api.REFIT_PEER, body)


@refit_router.post("/{operation:path}", status_code=404)
async def refit_unknown(operation: str) -> None:
    raise errors.NotFound(f"no refit operation {operation!r}: use prepare, checkpoint, nemo, megatron, status or abort")


async def _start_refit(
    agent: AgentServer, refit: sources.Request, path: str, body: agent_api.RefitRequest
) -> responses.JSONResponse:
    """Start ``refit`` on this rank, then on the pod's other ranks (the same body: each joins as its
    own rank); when one of them refuses, this rank's attempt is aborted too and the call fails."""
    with _refusals():
        snapshot = agent.refits.start(refit, asyncio.get_running_loop())
    own = _refit_status_body(agent, snapshot)
    others = await _forward(agent, path, body)
    return responses.JSONResponse(own if others is None else siblings_module.combine(own, others), status_code=202)


def _commit(body: agent_api.RefitRequest, *, trainer: bool = False) -> dict[str, Any]:
    """The request's commit fields; refuses a trainer's commit on a source without our trainer."""
    if body.commit == "trainer" and not trainer:
        raise errors.Conflict(
            "only a trainer on the megafleet wire (POST /v1/refit/prepare) commits: use commit operator",
            code="refit_mode_unsupported",
        )
    return {"commit": body.commit, "commit_grace_seconds": float(body.commit_grace_seconds)}


def _in_flight(body: agent_api.RefitRequest, *, verifies: bool = False) -> vocabulary.InFlightMode:
    """The request's in-flight mode; refuses integrity on a source that does not ``verify`` (NeMo's
    M-to-N reshard: its bulk carries no digest and its ranks' digests are not compared)."""
    if body.integrity != "none" and not verifies:
        raise errors.Conflict(
            "this engine verifies no bucket digests yet: integrity checksum is not built", code="refit_mode_unsupported"
        )
    return body.suspend_mode


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The controller's refusals of a refit or join as the agent answers them (409, or 400)."""
    try:
        yield
    except refit_controller.NotJoined as error:
        raise errors.Conflict(str(error), code="nemo_not_joined") from None
    except refit_controller.Busy as error:
        raise errors.Conflict(str(error), code="refit_in_progress") from None
    except refit_controller.Refused as error:
        raise errors.Conflict(str(error), code="refit_refused") from None
    except ValueError as error:
        raise errors.InvalidRequest(str(error), code="invalid_refit") from None


async def _forward(
    agent: AgentServer, path: str, body: pydantic.BaseModel, *, abort: bool = True
) -> list[dict[str, Any]] | None:
    """Send the call this rank accepted to the pod's other ranks (``None``: no others); when one of
    them refuses, this rank's attempt is aborted too (unless not ``abort``: a commit, which the
    operator repeats) and the call fails."""
    if agent.siblings is None:
        return None
    try:
        return await agent.siblings.post(path, body.model_dump(mode="json", by_alias=True))
    except siblings_module.SiblingError as error:
        if abort:
            agent.refits.abort(str(error))
        raise errors.Conflict(str(error), code="refit_refused") from None


def _pod_address(request: fastapi.Request) -> str | None:
    """The address the agent's socket is bound to (the pod IP), where the refit transport binds too;
    ``None`` when it is a wildcard (the route to the trainer decides then)."""
    server = request.scope.get("server")
    if not server:
        return None
    try:
        address = ipaddress.ip_address(server[0])
    except ValueError:
        return None
    return None if address.is_unspecified else str(address)


def _refit_status_body(agent: AgentServer, snapshot: refit_phases.Snapshot) -> dict[str, Any]:
    engine = agent.engine
    shown = reports.shown_world(agent.megatron.world(), agent.refits.world())
    held = reports.Held(agent.refits.dirty, engine.state, engine.weight_version, reports.world(*shown))
    return reports.status(snapshot, held)


def _state(agent: AgentServer) -> responses.JSONResponse:
    engine = agent.engine
    body = agent_api.StateResponse(
        state=engine.state,
        weight_version=engine.weight_version,
        served_address=agent.served_address,
        rank=agent.rank,
        world_size=agent.world_size,
        last_error=engine.last_error,
        queue_depth=engine.queue_depth,
        capabilities=agent_api.Capabilities(
            keep_modes=sorted(engine.backend.keep_modes),
            staging_bytes=engine.staging.bytes,
            staging_reason=engine.staging.reason,
        ),
    )
    return responses.JSONResponse(body.model_dump(mode="json", by_alias=True))
