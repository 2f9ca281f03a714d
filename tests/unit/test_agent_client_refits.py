"""The operator's agent client for Refits: ``GET /v1/state`` brings the engine's capabilities across a
refit (what an agent too old to say them answers counts as none), and a refit request puts the modes
it was given on the wire, camelCase, leaving out what was not set."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from helpers import agent_fakes
from megafleet import agent_client
from megafleet_protocol import agent_api

STATE: dict[str, Any] = {
    "state": "ready",
    "weightVersion": 3,
    "servedAddress": "10.0.0.7:8000",
    "rank": 0,
    "worldSize": 1,
    "lastError": None,
    "queueDepth": 0,
}


class Answering(agent_fakes.Agents):
    """Agents that answer every call with ``answer`` and remember the bodies they were sent."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__()
        self.answer = answer
        self.sent: list[tuple[str, Any]] = []

    async def _call(
        self, method: str, url: str, *, json: Any = None, headers: dict[str, str], timeout: float | None = None
    ) -> Any:
        self.sent.append((url, json))
        return agent_client._Answer(200, _dumps(self.answer))


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def test_the_state_brings_the_engines_capabilities_and_an_older_agent_has_none() -> None:
    capabilities = {"keepModes": ["persist", "recompute"], "stagingBytes": 1 << 30}
    found = asyncio.run(Answering({**STATE, "capabilities": capabilities}).state("10.0.0.7", "t0k"))
    older = asyncio.run(Answering(STATE).state("10.0.0.7", "t0k"))

    assert found.capabilities == agent_api.Capabilities(keep_modes=["persist", "recompute"], staging_bytes=1 << 30)
    assert (found.state, found.weight_version, found.error) == ("ready", 3, None)
    assert older.capabilities == agent_api.Capabilities() and older.capabilities.keep_modes == []


def test_a_refit_request_puts_its_modes_on_the_wire() -> None:
    agents = Answering({})
    body = agent_api.CheckpointRefitRequest(
        version=4, path="/c", suspend_mode="keep", kv_cache_mode="recompute", staging="auto"
    )

    assert asyncio.run(agents.refit_start("10.0.0.7", "t0k", body)) is None

    [(url, sent)] = agents.sent
    assert url.endswith(agent_api.REFIT_CHECKPOINT)
    assert sent == {"version": 4, "path": "/c", "suspendMode": "keep", "kvCacheMode": "recompute", "staging": "auto"}
