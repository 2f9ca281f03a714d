"""The operator's agent client for RefitSessions: each call goes to its route with the agent API's
camelCase body and the fleet's token, and a refusal comes back as an error text naming the status
(against an HTTP server on loopback that records what it is sent)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from aiohttp import web

from megafleet import agent_client
from megafleet_protocol import agent_api

RENDEZVOUS = agent_api.RendezvousBody(address="10.0.3.17", port=1473, world_size=4, rank_offset=2, trainer_world_size=2)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Seen:
    path: str
    authorization: str
    content: bytes


@asynccontextmanager
async def agent(seen: list[Seen], status: int) -> AsyncIterator[agent_client.AgentClient]:
    """An agent stand-in on 127.0.0.1 answering every request with ``status``, and a client of it."""

    async def answer(request: web.Request) -> web.Response:
        seen.append(Seen(request.path, request.headers.get("Authorization", ""), await request.read()))
        return web.json_response({"error": {"message": "no"}} if status >= 400 else {}, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = agent_client.AgentClient(port=port, timeout_seconds=5)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


def run(seen: list[Seen], status: int, calls: Callable[[agent_client.AgentClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with agent(seen, status) as client:
            return await calls(client)

    return asyncio.run(main())


def test_joins_leaves_and_session_refits_go_to_their_routes() -> None:
    seen: list[Seen] = []

    async def calls(agents: agent_client.AgentClient) -> list[str | None]:
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
            await agents.join("127.0.0.1", "t0k", nemo),
            await agents.join("127.0.0.1", "t0k", native),
            await agents.refit_start("127.0.0.1", "t0k", refit),
            await agents.refit_start("127.0.0.1", "t0k", swap),
        ]
        await agents.leave("127.0.0.1", "t0k", "uid-1", protocol="nemo")
        await agents.leave("127.0.0.1", "t0k", "uid-1", protocol="megatron")
        return answers

    assert run(seen, 202, calls) == [None, None, None, None]
    assert [request.path for request in seen] == [
        "/v1/refit/nemo/join",
        "/v1/refit/megatron/join",
        "/v1/refit/nemo",
        "/v1/refit/megatron",
        "/v1/refit/nemo/leave",
        "/v1/refit/megatron/leave",
    ]
    assert all(request.authorization == "Bearer t0k" for request in seen)
    join = json.loads(seen[0].content)
    assert join["session"] == "uid-1" and join["rendezvous"]["rankOffset"] == 2 and join["timeoutSeconds"] == 30
    assert json.loads(seen[1].content)["copyBackend"] == "gloo"
    assert json.loads(seen[2].content)["bucketBytes"] == 4096 and "rendezvous" not in json.loads(seen[2].content)
    assert json.loads(seen[4].content) == {"session": "uid-1"}


def test_the_reshard_stages_join_and_refit_go_to_their_routes() -> None:
    seen: list[Seen] = []
    stages = agent_api.NemoReshardJoinRequest(
        session="uid-1",
        stages=[agent_api.NemoReshardStage(address="10.0.3.17", port=1500)],
        trainer_ranks_per_stage=2,
        sub_world_size=4,
        rank_offset=3,
    )
    refit = agent_api.NemoReshardRefitRequest(
        version=5, session="uid-1", refit_info={"layer_names": []}, bucket_bytes=64
    )

    async def calls(agents: agent_client.AgentClient) -> list[str | None]:
        return [await agents.join("127.0.0.1", "t0k", stages), await agents.refit_start("127.0.0.1", "t0k", refit)]

    assert run(seen, 202, calls) == [None, None]
    assert [request.path for request in seen] == ["/v1/refit/nemo/reshard/join", "/v1/refit/nemo/reshard"]
    joined = json.loads(seen[0].content)
    assert (joined["stages"], joined["rankOffset"], joined["subWorldSize"]) == (
        [{"address": "10.0.3.17", "port": 1500}],
        3,
        4,
    )
    assert json.loads(seen[1].content) == {
        "version": 5,
        "session": "uid-1",
        "refitInfo": {"layer_names": []},
        "bucketBytes": 64,
    }


def test_a_refused_join_is_an_error_text_naming_the_status() -> None:
    body = agent_api.NemoJoinRequest(session="uid-1", rendezvous=RENDEZVOUS)
    error = run([], 409, lambda agents: agents.join("127.0.0.1", "t0k", body))
    assert error is not None and error.startswith("HTTP 409")


def test_an_agent_nobody_listens_for_is_unreachable_not_an_exception() -> None:
    async def main() -> tuple[agent_client.AgentState, str | None]:
        async with agent([], 200) as client:
            port = client.port
        dead = agent_client.AgentClient(port=port, timeout_seconds=5)  # the server above has stopped
        try:
            return await dead.state("127.0.0.1", "t0k"), await dead.suspend(
                "127.0.0.1", "t0k", mode="drain", timeout_seconds=1
            )
        finally:
            await dead.close()

    state, suspended = asyncio.run(main())
    assert state.state is None and state.error is not None and "unreachable" in state.error
    assert suspended is not None and "unreachable" in suspended
