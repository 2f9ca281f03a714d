"""The operator's client for the pod-local agents (``GET /v1/state``, suspend, resume, refit, join, leave).

Called by :mod:`megafleet.reconcile` to observe shards and verify served addresses, by the Refit
controller (:mod:`megafleet.refits.refit_controller`: start, collect and abort a refit) and by the
RefitSession controller (:mod:`megafleet.refits.session_controller`: join a trainer's world, leave
it). Requests and responses are the models of :mod:`megafleet_protocol.agent_api`, which the agent
itself validates with. Every call carries the
fleet's bearer token; a pod whose agent does not answer within the timeout (or answers something
malformed, or more than :data:`MAX_ANSWER_BYTES`) is reported as unreachable, never as an exception.
The calls go over aiohttp (Kopf's own HTTP client), as the operator's API requests do
(:mod:`megafleet.kube_rest`): a starting fleet of a thousand pods is probed thousands of times a minute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Literal

import aiohttp
import pydantic

from megafleet import metrics
from megafleet_protocol import agent_api, ports, vocabulary

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentState:
    """What one agent reports; ``error`` is set instead when it could not be asked."""

    state: vocabulary.EngineState | None = None
    weight_version: int | None = None
    served_address: str | None = None
    last_error: str | None = None
    capabilities: agent_api.Capabilities = dataclasses.field(default_factory=agent_api.Capabilities)
    """What its engine can do across a refit (keep modes, staging); an agent too old to say: nothing."""
    error: str | None = None


MAX_ANSWER_BYTES = 1024 * 1024
"""The most of an agent's answer the operator reads: its answers are a few KB (a state, a refit's
status), and what comes over the network is bounded before it is parsed. Read as it arrives and
refused past this; an answer whose length says more is refused unread."""


class AnswerTooLarge(aiohttp.ClientError):
    """An agent answered more than :data:`MAX_ANSWER_BYTES` (one of :data:`Unreachable`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"answered more than {limit} bytes: refused unread")


Unreachable = (aiohttp.ClientError, asyncio.TimeoutError)
"""What a call to an agent that cannot be reached (or that does not answer in time, or answers too
much: :class:`AnswerTooLarge`) raises."""


@dataclasses.dataclass(frozen=True)
class _Answer:
    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class AgentClient:
    """One HTTP client for all agents of all fleets (its session is made on first use, on the
    running event loop)."""

    def __init__(self, *, port: int = ports.AGENT_PORT, timeout_seconds: float) -> None:
        self.port = port
        self.timeout_seconds = timeout_seconds
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self, method: str, url: str, *, json: Any = None, headers: dict[str, str], timeout: float | None = None
    ) -> _Answer:
        """One call, sent again once if a kept-alive connection turned out closed (the agent's server
        drops idle connections after a few seconds, about as often as the operator observes): every
        agent call is idempotent, and a live agent must never look unreachable because of it. A
        refused connection is not sent again: nothing listens there."""
        metrics.AGENT_CALLS.labels(method=method).inc()
        if self._session is None:  # agents never compress: nothing is inflated unbounded
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        limit = aiohttp.ClientTimeout(total=timeout if timeout is not None else self.timeout_seconds)
        for attempt in (1, 2):
            try:
                async with self._session.request(method, url, json=json, headers=headers, timeout=limit) as response:
                    return _Answer(response.status, await _bounded(response, MAX_ANSWER_BYTES))
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError):
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def state(self, pod_ip: str, token: str) -> AgentState:
        try:
            response = await self._call(
                "GET", self._url(pod_ip, agent_api.STATE), headers={"Authorization": f"Bearer {token}"}
            )
        except AnswerTooLarge as error:
            return AgentState(error=f"agent at {pod_ip}:{self.port} {error}")
        except Unreachable as error:
            return AgentState(error=f"agent at {pod_ip}:{self.port} unreachable: {type(error).__name__}")
        if response.status_code != 200:
            return AgentState(error=f"agent at {pod_ip}:{self.port} answered HTTP {response.status_code}")
        try:
            body = agent_api.StateResponse.model_validate_json(response.content)
        except pydantic.ValidationError:
            return AgentState(error=f"agent at {pod_ip}:{self.port} answered a malformed state")
        return AgentState(
            state=body.state,
            weight_version=body.weight_version,
            served_address=body.served_address,
            last_error=body.last_error,
            capabilities=body.capabilities,
        )

    async def suspend(
        self, pod_ip: str, token: str, *, mode: vocabulary.SuspendMode, timeout_seconds: float
    ) -> str | None:
        """Ask an agent to suspend (``drain`` or ``abort``); returns an error text, or None on success."""
        body = agent_api.SuspendRequest(mode=mode, timeout_seconds=max(1, int(timeout_seconds)))
        try:
            response = await self._call(
                "POST",
                self._url(pod_ip, agent_api.SUSPEND),
                json=_json(body),
                headers={"Authorization": f"Bearer {token}"},
                timeout=timeout_seconds + self.timeout_seconds,
            )
        except Unreachable as error:
            return f"agent at {pod_ip}:{self.port} unreachable: {type(error).__name__}"
        return None if response.status_code == 200 else f"suspend answered HTTP {response.status_code}"

    async def refit_start(self, pod_ip: str, token: str, body: agent_api.RefitRequest) -> str | None:
        """Start a refit attempt: ``POST /v1/refit/prepare`` (a rendezvous request),
        ``/v1/refit/checkpoint``, ``/v1/refit/nemo`` (a session refit over a joined NeMo world),
        ``/v1/refit/nemo/reshard`` (the same with NeMo's M-to-N reshard), ``/v1/refit/megatron`` (a
        session refit over a joined megatron-core group) or ``/v1/refit/peer``; returns an error
        text, or None."""
        return await self._post(pod_ip, token, _REFIT_PATHS[type(body)], body)

    async def join(
        self,
        pod_ip: str,
        token: str,
        body: agent_api.NemoJoinRequest | agent_api.MegatronJoinRequest | agent_api.NemoReshardJoinRequest,
    ) -> str | None:
        """Join a trainer's world for a RefitSession (``POST /v1/refit/nemo/join`` or
        ``/v1/refit/megatron/join``), or the stage communicators of NeMo's reshard beside a joined
        NeMo world (``/v1/refit/nemo/reshard/join``); the pod's agent forwards it to its other local
        ranks; the join runs on in the pod and ``GET /v1/refit/status``'s ``world`` tells its outcome.
        Returns an error text, or None."""
        return await self._post(pod_ip, token, _JOIN_PATHS[type(body)], body)

    async def leave(self, pod_ip: str, token: str, session: str, *, protocol: Literal["nemo", "megatron"]) -> None:
        """``POST /v1/refit/nemo/leave`` or ``/v1/refit/megatron/leave``: drop the pod's membership of
        ``session``'s world (idempotent; an agent that cannot be reached holds nothing worth leaving)."""
        path = agent_api.REFIT_NEMO_LEAVE if protocol == "nemo" else agent_api.REFIT_MEGATRON_LEAVE
        error = await self._post(pod_ip, token, path, agent_api.NemoLeaveRequest(session=session))
        if error is not None:
            log.info("leaving session %s at %s: %s", session, pod_ip, error)

    async def _post(self, pod_ip: str, token: str, path: str, body: pydantic.BaseModel) -> str | None:
        """POST ``body``; an error text, or None when the agent accepted it (200 or 202)."""
        try:
            response = await self._call(
                "POST",
                self._url(pod_ip, path),
                json=_json(body),
                headers={"Authorization": f"Bearer {token}"},
            )
        except Unreachable as error:
            return f"agent at {pod_ip}:{self.port} unreachable: {type(error).__name__}"
        return None if response.status_code in (200, 202) else f"HTTP {response.status_code}: {response.text[:300]}"

    async def peer_send(self, pod_ip: str, token: str, body: agent_api.PeerSendRequest) -> str | None:
        """``POST /v1/peer/send``: send the pod's live weights to shards catching up (the pod's agent
        forwards it to its other local ranks); returns an error text, or None."""
        return await self._post(pod_ip, token, agent_api.PEER_SEND, body)

    async def peer_status(self, pod_ip: str, token: str) -> agent_api.PeerSendStatus | None:
        """``GET /v1/peer/status``: the pod's last peer copy, or None when the agent cannot be asked."""
        try:
            response = await self._call(
                "GET", self._url(pod_ip, agent_api.PEER_STATUS), headers={"Authorization": f"Bearer {token}"}
            )
            if response.status_code != 200:
                return None
            return agent_api.PeerSendStatus.model_validate_json(response.content)
        except (*Unreachable, pydantic.ValidationError):
            return None

    async def refit_abort(self, pod_ip: str, token: str, reason: str) -> None:
        """POST /v1/refit/abort; an agent that cannot be reached has nothing left to abort."""
        try:
            await self._call(
                "POST",
                self._url(pod_ip, agent_api.REFIT_ABORT),
                json=_json(agent_api.RefitAbortRequest(reason=reason[:1000])),
                headers={"Authorization": f"Bearer {token}"},
            )
        except Unreachable:
            return

    async def refit_commit(self, pod_ip: str, token: str, version: int) -> str | None:
        """``POST /v1/refit/commit``: the staged ``version`` goes live on the pod (idempotent); an error
        text (409: no attempt of the pod waits for that commit), or None."""
        return await self._post(pod_ip, token, agent_api.REFIT_COMMIT, agent_api.RefitCommitRequest(version=version))

    async def refit_status(self, pod_ip: str, token: str) -> agent_api.RefitStatusResponse | None:
        """GET /v1/refit/status, or None when the agent cannot be asked (or answers something malformed)."""
        try:
            response = await self._call(
                "GET", self._url(pod_ip, agent_api.REFIT_STATUS), headers={"Authorization": f"Bearer {token}"}
            )
        except Unreachable:
            return None
        if response.status_code != 200:
            return None
        try:
            return agent_api.RefitStatusResponse.model_validate_json(response.content)
        except pydantic.ValidationError:
            return None

    async def states(self, pod_ips: list[str], token: str) -> list[AgentState]:
        return list(await asyncio.gather(*(self.state(ip, token) for ip in pod_ips)))

    def _url(self, pod_ip: str, path: str) -> str:
        return f"http://{pod_ip}:{self.port}{path}"


async def _bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """``response``'s body, read as it arrives; :class:`AnswerTooLarge` past ``limit`` bytes (at
    once when its length says so)."""
    if response.content_length is not None and response.content_length > limit:
        raise AnswerTooLarge(limit)
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            raise AnswerTooLarge(limit)
    return bytes(body)


_REFIT_PATHS: dict[type[pydantic.BaseModel], str] = {
    agent_api.PrepareRequest: agent_api.REFIT_PREPARE,
    agent_api.CheckpointRefitRequest: agent_api.REFIT_CHECKPOINT,
    agent_api.NemoRefitRequest: agent_api.REFIT_NEMO,
    agent_api.MegatronRefitRequest: agent_api.REFIT_MEGATRON,
    agent_api.PeerRefitRequest: agent_api.REFIT_PEER,
    agent_api.NemoReshardRefitRequest: agent_api.REFIT_NEMO_RESHARD,
}
"""Where each kind of refit request starts its attempt."""
_JOIN_PATHS: dict[type[pydantic.BaseModel], str] = {
    agent_api.NemoJoinRequest: agent_api.REFIT_NEMO_JOIN,
    agent_api.MegatronJoinRequest: agent_api.REFIT_MEGATRON_JOIN,
    agent_api.NemoReshardJoinRequest: agent_api.REFIT_NEMO_RESHARD_JOIN,
}
"""Where each kind of join goes."""


def _json(body: pydantic.BaseModel) -> Any:
    """A request body as the agent reads it (camelCase; unset defaults left for the agent)."""
    return body.model_dump(mode="json", by_alias=True, exclude_unset=True)
