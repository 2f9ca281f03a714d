"""The engine's listening sockets: connections to the frontend, agent and metrics servers run with
Nagle's algorithm off. With it on, a response written in two pieces (uvicorn writes head and body
separately) waited for the client's delayed acknowledgement on every kept-alive request, 40 ms
each, which is what an OpenAI client or the operator's agent client (both keep connections alive)
would see. Checked on the connection asyncio accepts from :func:`megafleet_engine.server.bind`,
the way uvicorn serves it."""

from __future__ import annotations

import asyncio
import socket

import pytest

from megafleet_engine import server


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_connections_accepted_on_an_engine_listener_have_nagle_off(host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    seen: list[int] = []

    class Recorder(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted = transport.get_extra_info("socket")
            seen.append(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        listener = server.bind(host, 0)
        port = listener.getsockname()[1]
        loop = asyncio.get_running_loop()
        served = await loop.create_server(Recorder, sock=listener)
        try:
            reader, writer = await asyncio.open_connection(host, port)
            await reader.read()  # the server closes the connection once it looked at it
            writer.close()
        finally:
            served.close()
            await served.wait_closed()

    try:
        asyncio.run(accept_one())
    except OSError as error:
        if host == "::1":
            pytest.skip(f"IPv6 loopback unavailable here: {error}")
        raise
    assert seen == [1], "asyncio left Nagle's algorithm on for the accepted connection"
