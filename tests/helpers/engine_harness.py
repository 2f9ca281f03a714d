"""Shared harness of the engine tests (it holds no tests): the tiny model on CPU behind real HTTP
servers on 127.0.0.1.

:func:`serve` starts an :class:`~megafleet_engine.server.EngineServers` (frontend, agent, metrics on
free ports; the frontend in this process, or in API-server processes with ``api_servers``) in a
background thread with its own event loop, waits until the agent's ``/healthz`` (and the frontend's
``/health``) answers, and stops everything (servers, engine) on exit. :func:`tiny_backend` is built once per
session: tests run one at a time, and each test's engine is closed before the next one starts.

This is a module, not a ``conftest.py``: a second ``conftest`` module would replace the root one in
``sys.modules`` and break tests that import helpers from it. Test modules import this module and
declare the fixtures they use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

from helpers import engine_command
from megafleet_engine import backends, engine, metrics, server
from megafleet_engine.backends import transformers_backend
from megafleet_protocol import http_limits

MODEL = "tiny"
MAX_SEQUENCE_LENGTH = 256
AGENT_TOKEN = engine_command.AGENT_TOKEN
START_TIMEOUT_SECONDS = 30


@dataclasses.dataclass
class Served:
    """A running engine: its objects and where its servers listen."""

    engine: engine.Engine
    metrics: metrics.Metrics
    servers: server.EngineServers
    backend: transformers_backend.TransformersBackend

    @property
    def frontend_url(self) -> str:
        return f"http://{self.servers.address('frontend')}"

    @property
    def agent_url(self) -> str:
        return f"http://{self.servers.address('agent')}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.servers.address('metrics')}"

    def openai_client(self, api_key: str = "unused") -> openai.OpenAI:
        """The official client, unchanged (no retries, so a failure shows at once)."""
        return openai.OpenAI(base_url=f"{self.frontend_url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def agent(self, token: str | None = AGENT_TOKEN) -> httpx.Client:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return httpx.Client(base_url=self.agent_url, headers=headers, timeout=60)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.frontend_url, timeout=60)


@functools.cache
def tiny_backend() -> transformers_backend.TransformersBackend:
    """The tiny Llama on CPU (float32, 256-token context), built once per session."""
    backend = backends.load_backend(
        "transformers", "tiny://llama", name=MODEL, max_sequence_length=MAX_SEQUENCE_LENGTH, dtype="float32"
    )
    assert isinstance(backend, transformers_backend.TransformersBackend)
    return backend


token_file = engine_command.token_file  # one agent token file for every harness


@contextlib.contextmanager
def serve(
    backend: transformers_backend.TransformersBackend,
    token_file: Path,
    *,
    weight_version: int | None = 0,
    api_key: str | None = None,
    max_batch_size: int = 64,
    http: http_limits.HttpBounds = http_limits.DEFAULTS,
    api_servers: int = 0,
) -> Iterator[Served]:
    the_engine = engine.Engine(backend, max_batch_size=max_batch_size, weight_version=weight_version)
    the_metrics = metrics.Metrics(the_engine)
    try:
        servers = server.EngineServers(
            the_engine,
            backend.tokenizer,
            the_metrics,
            host="127.0.0.1",
            frontend_port=0,
            agent_port=0,
            metrics_port=0,
            agent_token_file=token_file,
            api_key=api_key,
            http=http,
            api_servers=api_servers,
        )
        served = Served(the_engine, the_metrics, servers, backend)
        failure: list[BaseException] = []

        def run() -> None:
            import asyncio

            try:
                asyncio.run(servers.serve())
            except BaseException as error:  # reported by the test thread
                failure.append(error)

        thread = threading.Thread(target=run, name="engine-servers", daemon=True)
        thread.start()
        try:
            _wait_healthy(served, thread)
            yield served
        finally:
            servers.stop()
            thread.join(timeout=30)
        assert not thread.is_alive(), "the servers did not stop"
        assert not failure, f"the servers failed: {failure}"
    finally:
        the_engine.close()


def _wait_healthy(served: Served, thread: threading.Thread) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    with httpx.Client(timeout=5) as client:
        # the agent healthy; the frontend answering at all (an engine without weights answers 503)
        for url, ok in ((f"{served.agent_url}/healthz", (200,)), (f"{served.frontend_url}/health", (200, 503))):
            while not _answers(client, url, ok):
                assert thread.is_alive(), "the servers exited during start-up"
                assert time.monotonic() < deadline, f"the servers did not answer within {START_TIMEOUT_SECONDS} s"
                time.sleep(0.02)  # polling a health endpoint for start-up, with a deadline


def _answers(client: httpx.Client, url: str, ok: tuple[int, ...]) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return client.get(url).status_code in ok
    return False
