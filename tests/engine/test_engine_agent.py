"""The agent API the operator calls: bearer-token authentication, state, suspend (drain and abort)
and resume as clients of the frontend see them, and the refit stubs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers import engine_harness as harness

pytestmark = pytest.mark.slow  # each test starts an engine, a server, Ray or a subprocess, or computes for a while

AUTHENTICATED = [
    ("GET", "/readyz", None),
    ("GET", "/v1/state", None),
    ("POST", "/v1/suspend", {"mode": "drain", "timeoutSeconds": 5}),
    ("POST", "/v1/resume", {}),
    ("POST", "/v1/refit/begin", {}),
]


AUTHORIZATION = [
    None,
    "Bearer wrong-token",
    f"Bearer {harness.AGENT_TOKEN}x",
    f"Basic {harness.AGENT_TOKEN}",
    harness.AGENT_TOKEN,
]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.Served]:
    """A ready engine serving weight version 0, no API key."""
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path)) as running:
        yield running


@pytest.mark.parametrize("authorization", AUTHORIZATION, ids=["none", "wrong", "longer", "basic", "no-scheme"])
@pytest.mark.parametrize(("method", "path", "body"), AUTHENTICATED, ids=[f"{m} {p}" for m, p, _ in AUTHENTICATED])
def test_agent_refuses_calls_without_the_token(
    served: harness.Served, authorization: str | None, method: str, path: str, body: Any
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    with httpx.Client(base_url=served.agent_url, headers=headers, timeout=30) as agent:
        response = agent.request(method, path, json=body)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert served.engine.state == "ready", "a refused call must not act"


@pytest.mark.parametrize("body", [b"{not json", b'{"mode": 7}'], ids=["malformed", "wrong-types"])
@pytest.mark.parametrize("path", ["/v1/suspend", "/v1/refit/prepare", "/v1/refit/nemo"])
def test_agent_authenticates_before_reading_the_body(served: harness.Served, path: str, body: bytes) -> None:
    """A caller without the token gets 401, never a 400 that tells it about its body
    (docs/incidents.md#agent-token-before-body)."""
    with httpx.Client(base_url=served.agent_url, timeout=30) as agent:
        response = agent.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "authentication_error"


def test_agent_state_with_the_token(served: harness.Served) -> None:
    with served.agent() as agent:
        state = agent.get("/v1/state")
        ready = agent.get("/readyz")
    assert state.status_code == 200 and ready.status_code == 200
    assert state.json() == {
        "state": "ready",
        "weightVersion": 0,
        "servedAddress": served.servers.served_address,
        "rank": 0,
        "worldSize": 1,
        "lastError": None,
        "queueDepth": 0,
        "capabilities": {
            "keepModes": ["persist", "recompute"],
            "stagingBytes": None,
            "stagingReason": "MEGAFLEET_REFIT_STAGING is off: this engine holds no staging copy",
        },
    }
    assert served.servers.served_address == served.frontend_url.removeprefix("http://")


def test_liveness_needs_no_token(served: harness.Served) -> None:
    with served.agent(None) as agent:
        assert agent.get("/healthz").status_code == 200


def test_suspend_drain_refuses_new_requests_and_resume_restores(served: harness.Served) -> None:
    with served.agent() as agent, served.openai_client() as client:
        suspended = agent.post("/v1/suspend", json={"mode": "drain", "timeoutSeconds": 10})
        assert suspended.json()["state"] == "suspended"
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=harness.MODEL, prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"]
        assert refused.value.code == "suspended"
        assert agent.get("/readyz").status_code == 503
        resumed = agent.post("/v1/resume", json={"weightVersion": 5})
        assert resumed.json()["state"] == "ready" and resumed.json()["weightVersion"] == 5
        raw = client.completions.with_raw_response.create(model=harness.MODEL, prompt="hi", max_tokens=2)
    assert raw.headers["x-megafleet-weight-version"] == "5"
    assert (raw.parse().model_extra or {})["weight_version"] == 5


def test_drain_lets_the_request_in_flight_finish(served: harness.Served) -> None:
    with served.openai_client() as client, served.agent() as agent:
        stream = client.completions.create(
            model=harness.MODEL, prompt="abc", max_tokens=60, stream=True, extra_body={"ignore_eos": True}
        )
        with stream:
            chunks = iter(stream)
            first = next(chunks)
            drained: list[dict[str, Any]] = []
            drain = threading.Thread(
                target=lambda: drained.append(
                    agent.post("/v1/suspend", json={"mode": "drain", "timeoutSeconds": 30}).json()
                )
            )
            drain.start()
            rest = list(chunks)
            drain.join(timeout=60)
    finishes = [choice.finish_reason for chunk in [first, *rest] for choice in chunk.choices if choice.finish_reason]
    assert finishes == ["length"], "a drain must not cut the request short"
    assert drained and drained[0]["state"] == "suspended" and drained[0]["queueDepth"] == 0


def test_suspend_abort_ends_the_stream_with_an_error_event(served: harness.Served) -> None:
    with served.openai_client() as client, served.agent() as agent:
        stream = client.completions.create(
            model=harness.MODEL, prompt="abc", max_tokens=240, stream=True, extra_body={"ignore_eos": True}
        )
        with stream, pytest.raises(openai.APIError) as aborted:
            for _ in stream:
                if agent.get("/v1/state").json()["state"] == "ready":
                    assert agent.post("/v1/suspend", json={"mode": "abort", "timeoutSeconds": 10}).status_code == 200
        assert "aborted" in aborted.value.message
        assert agent.get("/v1/state").json()["queueDepth"] == 0
        agent.post("/v1/resume", json={})
        assert client.completions.create(model=harness.MODEL, prompt="hi", max_tokens=2).choices


def test_agent_rejects_bad_bodies(served: harness.Served) -> None:
    with served.agent() as agent:
        bad_mode = agent.post("/v1/suspend", json={"mode": "pause"})
        bad_timeout = agent.post("/v1/suspend", json={"mode": "drain", "timeoutSeconds": 0})
        unknown_field = agent.post("/v1/resume", json={"version": 3})
        negative = agent.post("/v1/resume", json={"weightVersion": -1})
    for response in (bad_mode, bad_timeout, unknown_field, negative):
        assert response.status_code == 400, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert served.engine.state == "ready"
