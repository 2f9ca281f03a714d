"""A frontend whose engine does not accept requests closes each connection after its response
(``Connection: close``), so a client of a shard being drained for removal never keeps an idle
kept-alive connection that the server's exit would reset under its next request. A refit's hold
counts as accepting and keeps connections alive.

Real servers on 127.0.0.1 (the tiny model on CPU), the official client and raw sockets.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import engine_harness as harness

pytestmark = pytest.mark.slow  # each test starts an engine, a server, Ray or a subprocess, or computes for a while


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.Served]:
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path)) as running:
        yield running


def exchange(served: harness.Served, path: str) -> tuple[bytes, bool]:
    """Send one keep-alive request on a raw connection; the response's head, and whether the server
    closed the connection after the response (it keeps it open otherwise, until the read times out)."""
    address = served.servers.address("frontend")
    assert address is not None
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(f"GET {path} HTTP/1.1\r\nHost: engine\r\nConnection: keep-alive\r\n\r\n".encode())
        received = b""
        connection.settimeout(2.0)  # how long a kept-alive connection is watched for a close
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except TimeoutError:
            return received.split(b"\r\n\r\n", 1)[0], False
        return received.split(b"\r\n\r\n", 1)[0], True


def test_a_ready_engine_keeps_connections_alive(served: harness.Served) -> None:
    head, closed = exchange(served, "/v1/models")
    assert head.startswith(b"HTTP/1.1 200") and not closed
    assert b"connection: close" not in head.lower()


def test_a_draining_engine_closes_each_connection_after_its_response(served: harness.Served) -> None:
    answers: list[Any] = []
    with served.openai_client() as client:

        def complete() -> None:
            answers.append(
                client.completions.with_raw_response.create(model=harness.MODEL, prompt="hi", max_tokens=200)
            )

        thread = threading.Thread(target=complete)
        thread.start()
        deadline = time.monotonic() + 10
        while served.engine.running == 0:  # the engine's own counter: no event to wait on
            assert time.monotonic() < deadline, "the completion never started"
            time.sleep(0.005)
        # The shard is drained for removal: the request in flight is served to its end, and its
        # response closes its connection.
        asyncio.run(served.engine.suspend("drain"))
        thread.join(timeout=30)
    assert answers and answers[0].http_response.status_code == 200
    assert answers[0].headers["connection"] == "close"
    assert len(answers[0].parse().choices[0].text) > 0

    # A request on a new connection to the draining engine is refused, and its connection closed.
    head, closed = exchange(served, "/v1/models")
    assert closed and b"connection: close" in head.lower()
    head, closed = exchange(served, "/health")
    assert head.startswith(b"HTTP/1.1 503") and closed

    # Serving again: connections stay alive again.
    served.engine.resume()
    head, closed = exchange(served, "/health")
    assert head.startswith(b"HTTP/1.1 200") and not closed


def test_a_refit_hold_keeps_connections_alive(served: harness.Served) -> None:
    asyncio.run(served.engine.suspend("drain", hold=True))
    head, closed = exchange(served, "/health")
    assert head.startswith(b"HTTP/1.1 200") and not closed
    served.engine.resume()
