"""Bad input to the frontend: each malformed request gets a 4xx with the OpenAI error envelope, and
the same server (one per module) keeps answering good requests afterwards. Also: an engine that is
not serving answers 503 with Retry-After, a failure inside the engine is a 500 naming the request
(and its log line), and the optional API key."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from helpers import engine_harness as harness

GOOD_COMPLETION = {"model": harness.MODEL, "prompt": "hi", "max_tokens": 2}
GOOD_CHAT = {"model": harness.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def module_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Served]:
    """One server for the module: every bad request below must leave it serving."""
    token_file = harness.token_file(tmp_path_factory.mktemp("agent"))
    with harness.serve(harness.tiny_backend(), token_file) as running:
        yield running


def _chat(**changes: Any) -> dict[str, Any]:
    return {**GOOD_CHAT, **changes}


def _completion(**changes: Any) -> dict[str, Any]:
    return {**GOOD_COMPLETION, **changes}


# (id, path, method, body: raw bytes or a JSON value, status, expected code, expected param or None: unchecked)
CASES: list[tuple[str, str, str, Any, int, str | None, str | None]] = [
    ("bad-json-completion", "/v1/completions", "POST", b'{"model": "tiny", "prompt": ', 400, None, None),
    ("bad-json-chat", "/v1/chat/completions", "POST", b"{not json}", 400, None, None),
    ("body-not-an-object", "/v1/completions", "POST", [1, 2], 400, None, None),
    ("missing-model", "/v1/completions", "POST", {"prompt": "hi"}, 400, None, "model"),
    ("max-tokens-wrong-type", "/v1/completions", "POST", _completion(max_tokens="lots"), 400, None, "max_tokens"),
    ("messages-wrong-type", "/v1/chat/completions", "POST", _chat(messages="hi"), 400, None, "messages"),
    ("prompt-wrong-type", "/v1/completions", "POST", _completion(prompt={"text": "hi"}), 400, None, "prompt"),
    (
        "unknown-role",
        "/v1/chat/completions",
        "POST",
        _chat(messages=[{"role": "robot", "content": "x"}]),
        400,
        None,
        "messages.0.role",
    ),
    (
        "image-content",
        "/v1/chat/completions",
        "POST",
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        None,
        None,
    ),
    ("unknown-model", "/v1/completions", "POST", _completion(model="gpt-9"), 404, "model_not_found", "model"),
    ("unknown-model-chat", "/v1/chat/completions", "POST", _chat(model="gpt-9"), 404, "model_not_found", "model"),
    (
        "max-tokens-too-large",
        "/v1/completions",
        "POST",
        _completion(max_tokens=harness.MAX_SEQUENCE_LENGTH),
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    (
        "max-completion-tokens-too-large",
        "/v1/chat/completions",
        "POST",
        _chat(max_completion_tokens=harness.MAX_SEQUENCE_LENGTH),
        400,
        "context_length_exceeded",
        "max_completion_tokens",
    ),
    (
        "prompt-too-long",
        "/v1/completions",
        "POST",
        _completion(prompt=[65] * (harness.MAX_SEQUENCE_LENGTH + 1)),
        400,
        "context_length_exceeded",
        "prompt",
    ),
    (
        "chat-too-long",
        "/v1/chat/completions",
        "POST",
        _chat(messages=[{"role": "user", "content": "x" * harness.MAX_SEQUENCE_LENGTH}]),
        400,
        "context_length_exceeded",
        "messages",
    ),
    ("empty-messages", "/v1/chat/completions", "POST", _chat(messages=[]), 400, None, "messages"),
    ("empty-prompt", "/v1/completions", "POST", _completion(prompt=""), 400, None, "prompt"),
    ("empty-token-prompt", "/v1/completions", "POST", _completion(prompt=[]), 400, None, "prompt"),
    ("token-outside-vocabulary", "/v1/completions", "POST", _completion(prompt=[1, 10**6]), 400, None, "prompt"),
    ("n-zero", "/v1/completions", "POST", _completion(n=0), 400, None, "n"),
    ("max-tokens-zero", "/v1/completions", "POST", _completion(max_tokens=0), 400, None, "max_tokens"),
    ("negative-temperature", "/v1/chat/completions", "POST", _chat(temperature=-0.5), 400, None, "temperature"),
    ("top-p-zero", "/v1/completions", "POST", _completion(top_p=0), 400, None, "top_p"),
    ("top-k-below-minus-one", "/v1/completions", "POST", _completion(top_k=-2), 400, None, "top_k"),
    ("logprobs-too-many", "/v1/completions", "POST", _completion(logprobs=50), 400, None, "logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", "POST", _chat(top_logprobs=3), 400, None, None),
    ("empty-stop-string", "/v1/completions", "POST", _completion(stop=[""]), 400, None, "stop"),
    ("temperature-nan", "/v1/completions", "POST", _completion(temperature=float("nan")), 400, None, None),
    (
        "penalty-unsupported",
        "/v1/completions",
        "POST",
        _completion(presence_penalty=1.0),
        400,
        None,
        "presence_penalty",
    ),
    # Every number is bounded: beyond what the engine can take is a 400 naming the field, never a hang.
    ("top-k-beyond-32-bits", "/v1/completions", "POST", _completion(top_k=10**20), 400, None, "top_k"),
    ("top-k-beyond-32-bits-chat", "/v1/chat/completions", "POST", _chat(top_k=2**31), 400, None, "top_k"),
    (
        "stop-token-id-beyond-64-bits",
        "/v1/chat/completions",
        "POST",
        _chat(stop_token_ids=[10**20]),
        400,
        None,
        "stop_token_ids.0",
    ),
    ("stop-token-id-negative", "/v1/completions", "POST", _completion(stop_token_ids=[3, -1]), 400, None, None),
    (
        "stop-token-id-outside-vocabulary",
        "/v1/completions",
        "POST",
        _completion(stop_token_ids=[10**6]),
        400,
        None,
        "stop_token_ids",
    ),
    (
        "too-many-stop-token-ids",
        "/v1/completions",
        "POST",
        _completion(stop_token_ids=[1] * 257),
        400,
        None,
        "stop_token_ids",
    ),
    ("too-many-stop-strings", "/v1/completions", "POST", _completion(stop=["x"] * 17), 400, None, "stop"),
    ("stop-string-too-long", "/v1/chat/completions", "POST", _chat(stop="x" * 1001), 400, None, "stop"),
    ("logit-bias-unsupported", "/v1/completions", "POST", _completion(logit_bias={"7": 5}), 400, None, "logit_bias"),
    ("n-beyond-64-bits", "/v1/completions", "POST", _completion(n=10**20), 400, None, "n"),
    (
        "max-tokens-beyond-64-bits",
        "/v1/completions",
        "POST",
        _completion(max_tokens=10**20),
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    ("logprobs-beyond-64-bits", "/v1/completions", "POST", _completion(logprobs=10**20), 400, None, "logprobs"),
    (
        "top-logprobs-beyond-64-bits",
        "/v1/chat/completions",
        "POST",
        _chat(logprobs=True, top_logprobs=10**20),
        400,
        None,
        "top_logprobs",
    ),
    ("top-p-above-one", "/v1/completions", "POST", _completion(top_p=10**20), 400, None, "top_p"),
    (
        "temperature-overflows",
        "/v1/completions",
        "POST",
        b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}',
        400,
        None,
        "temperature",
    ),
    (
        "seed-beyond-json-numbers",
        "/v1/completions",
        "POST",
        b'{"model": "tiny", "prompt": "hi", "seed": 1' + b"0" * 5000 + b"}",
        400,
        None,
        None,
    ),
    ("penalty-huge", "/v1/chat/completions", "POST", _chat(frequency_penalty=1e300), 400, None, "frequency_penalty"),
    ("unknown-route", "/v1/embeddings", "POST", {"input": "x"}, 404, "not_found", None),
    ("wrong-method", "/v1/completions", "GET", None, 405, None, None),
]


@pytest.mark.parametrize(
    ("path", "method", "body", "status", "code", "param"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request_gets_an_error_envelope_and_the_server_keeps_serving(
    module_served: harness.Served, path: str, method: str, body: Any, status: int, code: str | None, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    with module_served.http() as http:
        response = http.request(method, path, content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and isinstance(error["type"], str)
        assert error["code"] == code
        if param is not None:
            assert error["param"] == param
        assert response.headers["x-megafleet-weight-version"] == "0"
        assert response.json()["weight_version"] == 0
        good = http.post("/v1/completions", json=GOOD_COMPLETION)
        assert good.status_code == 200, good.text


def test_openai_client_raises_typed_errors_with_the_message(module_served: harness.Served) -> None:
    with module_served.openai_client() as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=harness.MODEL, messages=[], max_tokens=2)
        assert "messages" in bad.value.message
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as too_long:
            client.completions.create(model=harness.MODEL, prompt="hi", max_tokens=harness.MAX_SEQUENCE_LENGTH)
        assert too_long.value.code == "context_length_exceeded"
        assert client.completions.create(model=harness.MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_deferred_weights_answer_503_loading_until_the_first_version(tmp_path: Path) -> None:
    with (
        harness.serve(harness.tiny_backend(), harness.token_file(tmp_path), weight_version=None) as served,
        served.http() as http,
        served.agent() as agent,
    ):
        refused = http.post("/v1/completions", json=GOOD_COMPLETION)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "loading"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert int(refused.headers["retry-after"]) > 0
        assert refused.headers["x-megafleet-weight-version"] == "none"
        assert http.get("/health").status_code == 503
        assert agent.get("/readyz").status_code == 503
        state = agent.get("/v1/state").json()
        assert (state["state"], state["weightVersion"]) == ("loading", None)
        assert agent.post("/v1/resume", json={}).status_code == 409, "no weights yet: nothing to resume"
        assert agent.post("/v1/resume", json={"weightVersion": 1}).json()["state"] == "ready"
        served_now = http.post("/v1/completions", json=GOOD_COMPLETION)
        assert served_now.status_code == 200
        assert served_now.json()["weight_version"] == 1
        assert agent.get("/readyz").status_code == 200


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_api_key_is_required_when_configured(tmp_path: Path) -> None:
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path), api_key="sk-fleet") as served:
        for key in ("wrong", "sk-fleetx"):
            with served.openai_client(api_key=key) as client, pytest.raises(openai.AuthenticationError):
                client.models.list()
        with served.http() as http:
            missing = http.get("/v1/models")
            assert missing.status_code == 401
            assert missing.json()["error"]["type"] == "authentication_error"
            assert http.get("/health").status_code == 200, "the health probe needs no key"
        with served.openai_client(api_key="sk-fleet") as client:
            assert client.completions.create(model=harness.MODEL, prompt="hi", max_tokens=2).usage is not None


def test_unreadable_secret_file_stops_start_up(tmp_path: Path) -> None:
    """A configured but unreadable key file stops start-up instead of serving without a key."""
    from megafleet_engine import server

    with pytest.raises(RuntimeError, match="API key"):
        server.read_secret(tmp_path / "missing", what="API key")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RuntimeError, match="empty"):
        server.read_secret(tmp_path / "empty", what="API key")


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_http_client_sees_weight_version_on_streams(module_served: harness.Served) -> None:
    with (
        module_served.http() as http,
        http.stream("POST", "/v1/completions", json={**GOOD_COMPLETION, "stream": True}) as response,
    ):
        assert response.headers["x-megafleet-weight-version"] == "0"
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(event[len("data: ") :])["weight_version"] == 0 for event in events[:-1])


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_failure_inside_the_engine_is_a_500_naming_the_request_and_serving_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A row of NaN weights makes sampling fail inside the engine's backend (torch refuses a NaN
    distribution): that request is a 500 with the OpenAI body, its message and an error log line name
    its id; with the weights back, the engine serves the same greedy tokens as before."""
    backend = harness.tiny_backend()
    weight = backend.model.get_output_embeddings().weight
    saved = weight.detach().clone()
    greedy = {**GOOD_COMPLETION, "max_tokens": 4, "temperature": 0}
    with harness.serve(backend, harness.token_file(tmp_path)) as served, served.http() as http:
        before = http.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
        try:
            with torch.no_grad():
                weight[7] = float("nan")
            failed = http.post("/v1/completions", json={**GOOD_COMPLETION, "temperature": 1.0})
        finally:
            with torch.no_grad():
                weight.copy_(saved)
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert (error["type"], error["code"]) == ("internal_error", "internal_error")
        named = re.search(r"\(request (cmpl-[0-9a-f]+)\)", error["message"])
        assert named is not None and error["message"].startswith("generation failed"), error["message"]
        assert [
            record
            for record in caplog.records
            if record.levelno == logging.ERROR and f"request {named.group(1)} failed" in record.getMessage()
        ]
        after = http.post("/v1/completions", json=greedy)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == before


def test_the_agent_refuses_a_weight_version_beyond_what_every_message_carries(module_served: harness.Served) -> None:
    """A version is bounded like a Refit's (2**53): a larger one would reach the engine core's
    64-bit messages to its API servers, and every answer stamped with it."""
    with module_served.agent() as agent:
        refused = agent.post("/v1/resume", json={"weightVersion": 2**64})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "weightVersion"
        assert agent.get("/v1/state").json()["weightVersion"] == 0
