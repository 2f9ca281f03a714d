"""The pieces of :mod:`megafleet_engine.http_server` that need no server: the open-files limit a
serving process gives itself, and the uvicorn configuration every server of the pod gets."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import fastapi
import pytest

from megafleet_engine import http_server
from megafleet_protocol import http_limits


@pytest.fixture
def open_files() -> Iterator[tuple[int, int]]:
    """This process's open-files limits, restored after the test."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        yield limits
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def test_a_serving_process_raises_its_open_files_limit_up_to_the_hard_one(open_files: tuple[int, int]) -> None:
    hard = open_files[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # containerd 2 starts containers at 1024
    wanted = 1000 + http_server.OWN_FILES
    expected = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    assert http_server.allow_open_files(1000) == expected
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (expected, hard)
    assert http_server.allow_open_files(10) == expected, "never lowered"


def test_every_server_is_bounded_and_takes_no_websockets() -> None:
    limits = http_limits.HttpLimits(7, header_timeout_seconds=3, keep_alive_seconds=9, max_body_bytes=100)
    config = http_server.config(fastapi.FastAPI(), limits, name="agent")
    config.load()
    protocol = config.http_protocol_class
    assert issubclass(protocol, http_server.BoundedH11Protocol)
    assert (protocol.limits, protocol.server_name) == (limits, "agent")
    assert protocol.lame_duck_seconds == 0, "the agent's clients retry: its idle connections close at once"
    frontend = http_server.config(fastapi.FastAPI(), limits, name="frontend")
    frontend.load()
    served = frontend.http_protocol_class
    assert issubclass(served, http_server.BoundedH11Protocol)
    assert served.lame_duck_seconds == http_server.LAME_DUCK_SECONDS
    assert config.ws_protocol_class is None
    assert (config.timeout_keep_alive, config.h11_max_incomplete_event_size) == (9, http_server.MAX_HEAD_BYTES)
    assert isinstance(config.app, http_server.BodyLimit) and config.app.max_bytes == 100
