"""The operator reads at most :data:`megafleet.agent_client.MAX_ANSWER_BYTES` of an agent's answer,
against an HTTP server on loopback: an answer whose length says more is refused unread, one that
streams more is cut off as it arrives (memory flat), and a compressed one is never inflated; each
is reported like an agent that cannot be asked, never as an exception."""

from __future__ import annotations

import asyncio
import gzip
import json
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from aiohttp import web

from megafleet import agent_client
from megafleet_protocol import agent_api

T = TypeVar("T")
MIB = 1024 * 1024
STATE = {
    "state": "ready",
    "weightVersion": 3,
    "servedAddress": "127.0.0.1:8000",
    "rank": 0,
    "worldSize": 1,
    "lastError": None,
    "queueDepth": 0,
}


async def sized(request: web.Request) -> web.Response:
    """A state padded to 2 MiB, its length declared."""
    return web.json_response({**STATE, "lastError": "x" * 2 * MIB})


async def streamed(request: web.Request) -> web.StreamResponse:
    """64 MiB of a never-ending JSON string, chunked (no length declared)."""
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    await response.write(b'{"state": "ready", "lastError": "')
    chunk = b"x" * (64 * 1024)
    try:
        for _ in range(1024):
            await response.write(chunk)
    except (ConnectionError, RuntimeError):  # the client hung up, as it should
        pass
    return response


async def compressed(request: web.Request) -> web.Response:
    """A state gzip'd with Content-Encoding: a small body that would inflate past the bound."""
    body = gzip.compress(json.dumps({**STATE, "lastError": " " * 8 * MIB}).encode())
    return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})


async def plain(request: web.Request) -> web.Response:
    return web.json_response(STATE)


@asynccontextmanager
async def agent(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[agent_client.AgentClient]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    client = agent_client.AgentClient(port=runner.addresses[0][1], timeout_seconds=10)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


def run(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    call: Callable[[agent_client.AgentClient], Awaitable[T]],
) -> T:
    async def main() -> T:
        async with agent(handler) as client:
            return await call(client)

    return asyncio.run(main())


def state(client: agent_client.AgentClient) -> Awaitable[agent_client.AgentState]:
    return client.state("127.0.0.1", "t0k")


def test_an_ordinary_answer_is_read() -> None:
    assert run(plain, state) == agent_client.AgentState(
        state="ready", weight_version=3, served_address="127.0.0.1:8000"
    )


def test_an_answer_declared_larger_than_the_bound_is_refused_unread() -> None:
    found = run(sized, state)
    assert found.state is None and found.error is not None
    assert found.error.startswith("agent at 127.0.0.1:") and found.error.endswith(
        f"answered more than {MIB} bytes: refused unread"
    )


def test_an_answer_streaming_past_the_bound_is_cut_off_with_memory_flat() -> None:
    tracemalloc.start()
    try:
        found = run(streamed, state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found.error is not None and found.error.endswith(f"answered more than {MIB} bytes: refused unread")
    assert peak < 16 * MIB, f"peak {peak / MIB:.1f} MiB for a 64 MiB answer"


def test_a_compressed_answer_is_never_inflated() -> None:
    found = run(compressed, state)
    assert found.error is not None and found.error.endswith("answered a malformed state")


def test_a_refit_status_past_the_bound_is_no_answer() -> None:
    async def status(client: agent_client.AgentClient) -> agent_api.RefitStatusResponse | None:
        return await client.refit_status("127.0.0.1", "t0k")

    assert run(sized, status) is None
    assert run(streamed, status) is None
