"""The operator's agent client for RefitSessions: each call goes to its route with the agent API's
camelCase body and the fleet's token, and a refusal comes back as an error text naming the status."""

from __future__ import annotations

import asyncio
import json

import httpx

from megafleet import agent_client
from megafleet_protocol import agent_api

RENDEZVOUS = agent_api.RendezvousBody(address="10.0.3.17", port=1473, world_size=4, rank_offset=2, trainer_world_size=2)


def client(seen: list[httpx.Request], status: int = 202) -> agent_client.AgentClient:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, json={"error": {"message": "no"}} if status >= 400 else {})

    found = agent_client.AgentClient(timeout_seconds=1)
    found._http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return found


def test_joins_leaves_and_session_refits_go_to_their_routes() -> None:
    seen: list[httpx.Request] = []
    agents = client(seen)

    async def calls() -> list[str | None]:
        nemo = agent_api.NemoJoinRequest(session="uid-1", rendezvous=RENDEZVOUS, timeout_seconds=30)
        native = agent_api.MegatronJoinRequest(session="uid-1", rendezvous=RENDEZVOUS, copy_backend="gloo")
        refit = agent_api.NemoRefitRequest(
            version=3,
            session="uid-1",
            refit_info=[agent_api.NemoTensor(name="w", shape=[2], dtype="float32")],
            bucket_bytes=4096,
        )
        swap = agent_api.MegatronRefitRequest(version=4, session="uid-1")
        answers = [
            await agents.join("10.1.0.5", "t0k", nemo),
            await agents.join("10.1.0.5", "t0k", native),
            await agents.refit_start("10.1.0.5", "t0k", refit),
            await agents.refit_start("10.1.0.5", "t0k", swap),
        ]
        await agents.leave("10.1.0.5", "t0k", "uid-1", protocol="nemo")
        await agents.leave("10.1.0.5", "t0k", "uid-1", protocol="megatron")
        await agents.close()
        return answers

    assert asyncio.run(calls()) == [None, None, None, None]
    assert [request.url.path for request in seen] == [
        "/v1/refit/nemo/join",
        "/v1/refit/megatron/join",
        "/v1/refit/nemo",
        "/v1/refit/megatron",
        "/v1/refit/nemo/leave",
        "/v1/refit/megatron/leave",
    ]
    assert all(request.headers["Authorization"] == "Bearer t0k" for request in seen)
    join = json.loads(seen[0].content)
    assert join["session"] == "uid-1" and join["rendezvous"]["rankOffset"] == 2 and join["timeoutSeconds"] == 30
    assert json.loads(seen[1].content)["copyBackend"] == "gloo"
    assert json.loads(seen[2].content)["bucketBytes"] == 4096 and "rendezvous" not in json.loads(seen[2].content)
    assert json.loads(seen[4].content) == {"session": "uid-1"}


def test_a_refused_join_is_an_error_text_naming_the_status() -> None:
    seen: list[httpx.Request] = []
    agents = client(seen, status=409)
    body = agent_api.NemoJoinRequest(session="uid-1", rendezvous=RENDEZVOUS)

    async def call() -> str | None:
        try:
            return await agents.join("10.1.0.5", "t0k", body)
        finally:
            await agents.close()

    error = asyncio.run(call())

    assert error is not None and error.startswith("HTTP 409")
