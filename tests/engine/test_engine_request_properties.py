"""Property (hypothesis): every request to the frontend gets an answer within a deadline, never a
hang and never a 5xx, and the engine still serves the same greedy tokens afterwards.

Requests are drawn over the request schema of the three POST endpoints (completions, chat, chat
batch): a valid base request with some of its fields (any field the schema knows, and a few it
does not) replaced by values of their type, values at and beyond every integer width the engine
meets (32 and 64 bits, signed and not), extreme floats, and values of the wrong type. Each is sent
as raw JSON with httpx to the tiny model served in this process: its frontend in this process, or in
an API-server process (whose requests cross the engine core's 64-bit IPC messages). A valid streamed
request must end its stream with ``[DONE]`` and carry no error event; a refused one must be a 4xx
with the OpenAI error body. After each request the greedy answer to a fixed prompt must be the one
the engine gave before the first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import engine_harness as harness

pytestmark = pytest.mark.slow  # starts an engine (and an API-server process) and sends a few hundred requests

DEADLINE_SECONDS = 30.0
"""Longest any drawn request may take (each is a few tokens; the margin is for a loaded machine)."""
GREEDY = {"model": harness.MODEL, "prompt": "The tiny model", "max_tokens": 4, "temperature": 0, "ignore_eos": True}

WIDTHS = [2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**20, 10**300]
integers = st.one_of(
    st.integers(-3, 300),
    st.sampled_from(WIDTHS + [-width for width in WIDTHS]),
    st.integers(),
)
floats = st.one_of(
    st.floats(-3, 3),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-5, 0.5, 1.0, 2.0, 1e38, 3.5e38, 1e300, 1.7976931348623157e308]),
    st.floats(allow_nan=False, allow_infinity=False),
)
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=6),
    st.lists(integers, max_size=3),
    st.dictionaries(st.text(max_size=3), integers, max_size=2),
)
numbers = st.one_of(integers, floats)
sizes = st.one_of(st.integers(-3, 8), st.sampled_from(WIDTHS + [-width for width in WIDTHS]), junk)
"""For what sets a request's cost (n, completion lengths): small valid values and every width, so a
valid draw stays cheap."""
texts = st.text(max_size=12)
token_lists = st.lists(integers, max_size=6)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": texts})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot"])},
    optional={"content": st.one_of(texts, st.lists(part, max_size=2), junk), "name": st.one_of(texts, junk)},
)
conversation = st.lists(message, max_size=3)

FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.sampled_from([harness.MODEL, "gpt-9", ""]), junk),
    "n": sizes,
    "max_tokens": sizes,
    "temperature": st.one_of(floats, integers, junk),
    "top_p": st.one_of(floats, integers, junk),
    "top_k": st.one_of(integers, floats, junk),
    "seed": st.one_of(integers, floats, junk),
    "stop": st.one_of(texts, st.lists(texts, max_size=20), st.text(min_size=990, max_size=1010), junk),
    "stop_token_ids": st.one_of(token_lists, st.lists(st.integers(0, 100), max_size=300), junk),
    "ignore_eos": st.one_of(st.booleans(), junk),
    "stream": st.one_of(st.booleans(), junk),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "presence_penalty": st.one_of(numbers, junk),
    "frequency_penalty": st.one_of(numbers, junk),
    "logit_bias": st.one_of(st.dictionaries(st.sampled_from(["1", "50", "x"]), numbers, max_size=2), junk),
    "return_token_ids": st.one_of(st.booleans(), junk),
    "detokenize": st.one_of(st.booleans(), junk),
    "logprobs_mode": st.one_of(st.sampled_from(["processed_logprobs", "raw_logprobs", "other"]), junk),
    "user": st.one_of(texts, junk),
    "unknown_field": numbers,
    "best_of": numbers,
}
COMPLETION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(texts, token_lists, st.lists(st.one_of(texts, token_lists), max_size=3), junk),
    "logprobs": st.one_of(integers, junk),
    "echo": st.one_of(st.booleans(), junk),
    "suffix": st.one_of(texts, junk),
}
CHAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.one_of(conversation, junk),
    "max_completion_tokens": sizes,
    "logprobs": st.one_of(st.booleans(), junk),
    "top_logprobs": st.one_of(integers, junk),
}
BATCH_FIELDS = {**CHAT_FIELDS, "messages": st.one_of(st.lists(conversation, max_size=3), junk)}

USER = {"role": "user", "content": "hi"}
ENDPOINTS: dict[str, tuple[dict[str, Any], dict[str, st.SearchStrategy[Any]]]] = {
    "/v1/completions": ({"model": harness.MODEL, "prompt": "hi", "max_tokens": 2}, {**FIELDS, **COMPLETION_FIELDS}),
    "/v1/chat/completions": ({"model": harness.MODEL, "messages": [USER], "max_tokens": 2}, {**FIELDS, **CHAT_FIELDS}),
    "/v1/chat/completions/batch": (
        {"model": harness.MODEL, "messages": [[USER], [USER]], "max_tokens": 2},
        {**FIELDS, **BATCH_FIELDS},
    ),
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """An endpoint and a body: its valid base with one to four fields replaced."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, fields = ENDPOINTS[path]
    names = draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True))
    return path, {**base, **{name: draw(fields[name]) for name in names}}


@pytest.fixture(scope="module", params=[0, 1], ids=["frontend-in-process", "api-server-process"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[harness.Served, list[str]]]:
    """A served engine and its greedy answer to :data:`GREEDY` before any drawn request."""
    token_file = harness.token_file(tmp_path_factory.mktemp("agent"))
    with harness.serve(harness.tiny_backend(), token_file, api_servers=request.param) as running:
        with httpx.Client(base_url=running.frontend_url, timeout=DEADLINE_SECONDS) as http:
            greedy = _greedy(http)
        yield running, greedy


def _greedy(http: httpx.Client) -> list[str]:
    response = http.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in response.json()["choices"]]


def _answer(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    """Send one request; assert it is answered in time: served (a whole stream), or refused (4xx)."""
    content = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    started = time.monotonic()
    with http.stream("POST", path, content=content, headers=headers) as response:
        data = response.read()
    took = time.monotonic() - started
    assert took < DEADLINE_SECONDS, f"{took:.1f} s for {path} {body!r}"
    assert response.status_code < 500, f"{response.status_code} for {path} {body!r}: {data[:400]!r}"
    if response.status_code != 200:
        error = json.loads(data)["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"], data
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len(b"data: ") :] for line in data.splitlines() if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", data[-400:]
        assert not [event for event in events[:-1] if b'"error"' in event[:20]], data[-400:]
    else:
        assert json.loads(data)["choices"], data[:400]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@example(("/v1/completions", {"model": harness.MODEL, "prompt": "hi", "max_tokens": 2, "top_k": 10**20}))
@example(("/v1/chat/completions", {"model": harness.MODEL, "messages": [USER], "stop_token_ids": [10**20]}))
@example(
    ("/v1/chat/completions/batch", {"model": harness.MODEL, "messages": [[USER]], "max_tokens": 2, "seed": -(2**90)})
)
@given(drawn=requests())
def test_every_request_is_answered_in_time_and_greedy_tokens_stay(
    served: tuple[harness.Served, list[str]], drawn: tuple[str, dict[str, Any]]
) -> None:
    engine, greedy = served
    path, body = drawn
    with httpx.Client(base_url=engine.frontend_url, timeout=DEADLINE_SECONDS) as http:
        _answer(http, path, body)
        assert _greedy(http) == greedy, f"greedy tokens changed after {path} {body!r}"
