"""The operator's client for the pod-local agents (``GET /v1/state``, suspend, resume, refit).

Called by :mod:`megafleet.reconcile` to observe shards and verify served addresses, and by the
refit orchestration. Every call carries the fleet's bearer token; a pod whose agent does not
answer within the timeout is reported as unreachable, never as an exception.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx

from megafleet.api import v1alpha1

TIMEOUT_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class AgentState:
    """What one agent reports; ``error`` is set instead when it could not be asked."""

    state: str | None = None
    weight_version: int | None = None
    served_address: str | None = None
    last_error: str | None = None
    error: str | None = None


class AgentClient:
    """One HTTP client for all agents of all fleets."""

    def __init__(self, *, port: int = v1alpha1.AGENT_PORT, timeout_seconds: float = TIMEOUT_SECONDS) -> None:
        self.port = port
        self._http = httpx.AsyncClient(timeout=timeout_seconds)

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """One call, sent again once if a kept-alive connection turned out closed (the agent's server
        drops idle connections after a few seconds, about as often as the operator observes): every
        agent call is idempotent, and a live agent must never look unreachable because of it."""
        try:
            return await self._http.request(method, url, **kwargs)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
            return await self._http.request(method, url, **kwargs)

    async def state(self, pod_ip: str, token: str) -> AgentState:
        try:
            response = await self._call(
                "GET", f"http://{pod_ip}:{self.port}/v1/state", headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.HTTPError as error:
            return AgentState(error=f"agent at {pod_ip}:{self.port} unreachable: {type(error).__name__}")
        if response.status_code != 200:
            return AgentState(error=f"agent at {pod_ip}:{self.port} answered HTTP {response.status_code}")
        body: dict[str, Any] = response.json()
        return AgentState(
            state=body.get("state"),
            weight_version=body.get("weightVersion"),
            served_address=body.get("servedAddress"),
            last_error=body.get("lastError"),
        )

    async def suspend(self, pod_ip: str, token: str, *, mode: str, timeout_seconds: float) -> str | None:
        """Ask an agent to suspend (``drain`` or ``abort``); returns an error text, or None on success."""
        try:
            response = await self._http.post(
                f"http://{pod_ip}:{self.port}/v1/suspend",
                json={"mode": mode, "timeoutSeconds": max(1, int(timeout_seconds))},
                headers={"Authorization": f"Bearer {token}"},
                timeout=timeout_seconds + TIMEOUT_SECONDS,
            )
        except httpx.HTTPError as error:
            return f"agent at {pod_ip}:{self.port} unreachable: {type(error).__name__}"
        return None if response.status_code == 200 else f"suspend answered HTTP {response.status_code}"

    async def refit_start(self, pod_ip: str, token: str, operation: str, body: dict[str, Any]) -> str | None:
        """POST /v1/refit/<operation> (prepare or checkpoint); returns an error text, or None."""
        try:
            response = await self._call(
                "POST",
                f"http://{pod_ip}:{self.port}/v1/refit/{operation}",
                json=body,
                headers={"Authorization": f"Bearer {token}"},
            )
        except httpx.HTTPError as error:
            return f"agent at {pod_ip}:{self.port} unreachable: {type(error).__name__}"
        return None if response.status_code in (200, 202) else f"HTTP {response.status_code}: {response.text[:300]}"

    async def refit_abort(self, pod_ip: str, token: str, reason: str) -> None:
        """POST /v1/refit/abort; an agent that cannot be reached has nothing left to abort."""
        try:
            await self._call(
                "POST",
                f"http://{pod_ip}:{self.port}/v1/refit/abort",
                json={"reason": reason[:1000]},
                headers={"Authorization": f"Bearer {token}"},
            )
        except httpx.HTTPError:
            return

    async def refit_status(self, pod_ip: str, token: str) -> dict[str, Any] | None:
        """GET /v1/refit/status, or None when the agent cannot be asked."""
        try:
            response = await self._call(
                "GET", f"http://{pod_ip}:{self.port}/v1/refit/status", headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        body: dict[str, Any] = response.json()
        return body

    async def states(self, pod_ips: list[str], token: str) -> list[AgentState]:
        return list(await asyncio.gather(*(self.state(ip, token) for ip in pod_ips)))
