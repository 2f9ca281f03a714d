"""Hostile input to the frontend as a pod serves it (the engine core and an API-server process, raw
HTTP on loopback): text that is not Unicode is a 400 with the OpenAI error body naming the field
(never a 500), and nothing a request names can forge or flood a line of the engine's log. The
bound on prompts x n is in ``test_engine_batching.py``; the pure helpers are checked here too."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from helpers import engine_command
from megafleet_engine import api_server
from megafleet_engine.openai import protocol

MODEL = engine_command.MODEL
COMPLETION = b'"model":"tiny","max_tokens":2'
CHAT = b'"model":"tiny","max_tokens":2,"messages":'


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[engine_command.EngineProcess]:
    token = engine_command.token_file(tmp_path_factory.mktemp("agent"))
    process = engine_command.EngineProcess("127.0.0.1", token, env={"MEGAFLEET_API_SERVERS": "1"})
    try:
        process.wait_serving()
        _wait_for(lambda: _healthy(process), "the API server to answer")
        yield process
    finally:
        process.close()


def _healthy(engine: engine_command.EngineProcess) -> bool:
    try:
        return httpx.get(f"http://{engine.addresses['frontend']}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling a process's state or log, with a deadline


def _post(engine: engine_command.EngineProcess, path: str, body: bytes) -> httpx.Response:
    """``body`` as raw bytes: JSON's ``\\ud800`` escapes, which no JSON encoder of a client writes."""
    url = f"http://{engine.addresses['frontend']}{path}"
    return httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)


# (id, path, raw JSON body, the field the error must name)
SURROGATES = [
    ("prompt", "/v1/completions", b"{" + COMPLETION + b',"prompt":"a\\ud800b"}', "prompt"),
    ("prompt-list", "/v1/completions", b"{" + COMPLETION + b',"prompt":["ok","\\udc00"]}', "prompt.1"),
    (
        "chat-content",
        "/v1/chat/completions",
        b"{" + CHAT + b'[{"role":"user","content":"\\ud83d"}]}',
        "messages.0.content",
    ),
    (
        "chat-content-part",
        "/v1/chat/completions",
        b"{" + CHAT + b'[{"role":"user","content":[{"type":"text","text":"x\\udfff"}]}]}',
        "messages.0.content.0.text",
    ),
    (
        "chat-batch-content",
        "/v1/chat/completions/batch",
        b"{" + CHAT + b'[[{"role":"user","content":"ok"}],[{"role":"user","content":"\\ud800"}]]}',
        "messages.1.0.content",
    ),
    ("model-completion", "/v1/completions", b'{"model":"ti\\ud800ny","prompt":"a"}', "model"),
    ("model-chat", "/v1/chat/completions", b'{"model":"\\udbff","messages":[{"role":"user","content":"a"}]}', "model"),
    ("stop", "/v1/completions", b"{" + COMPLETION + b',"prompt":"a","stop":["\\ud800"]}', "stop.0"),
    ("field-name", "/v1/completions", b"{" + COMPLETION + b',"prompt":"a","x\\ud800":1}', "body"),
]


@pytest.mark.slow  # starts a megafleet-engine process (module-scoped)
@pytest.mark.parametrize(("path", "body", "param"), [case[1:] for case in SURROGATES], ids=[c[0] for c in SURROGATES])
def test_lone_surrogates_are_a_400_naming_the_field(
    engine: engine_command.EngineProcess, path: str, body: bytes, param: str
) -> None:
    response = _post(engine, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert "surrogate" in error["message"] and error["message"].startswith(f"{param}: ")
    assert response.json()["weight_version"] == 0


# (id, path, JSON body, the field the 400 must name): numbers beyond 64 bits, which the API server
# once could not encode for the engine core, so the request (and every other of that event-loop
# turn) was never answered.
BEYOND_64_BITS = [
    ("top-k", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2, "top_k": 10**20}, "top_k"),
    (
        "chat-stop-token-ids",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "stop_token_ids": [10**20]},
        "stop_token_ids.0",
    ),
    (
        "chat-batch-top-k",
        "/v1/chat/completions/batch",
        {"model": MODEL, "messages": [[{"role": "user", "content": "a"}]], "max_tokens": 2, "top_k": -(10**20)},
        "top_k",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in BEYOND_64_BITS], ids=[c[0] for c in BEYOND_64_BITS])
def test_numbers_beyond_64_bits_are_a_400_at_once(
    engine: engine_command.EngineProcess, path: str, body: dict[str, object], param: str
) -> None:
    url = f"http://{engine.addresses['frontend']}{path}"
    response = httpx.post(url, json=body, timeout=10)  # once: no answer until the client gave up
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.slow
def test_the_largest_numbers_taken_reach_the_engine_core_and_are_served(engine: engine_command.EngineProcess) -> None:
    """Numbers at the edges of what is valid travel to the engine core (64-bit messages) and back:
    top_k just under 2**31 (no cut: beyond the vocabulary), any seed (taken modulo 2**64), a huge
    temperature, the highest stop token id of the vocabulary."""
    url = f"http://{engine.addresses['frontend']}/v1/completions"
    body = {
        "model": MODEL,
        "prompt": "abc",
        "n": 2,
        "max_tokens": 3,
        "ignore_eos": True,
        "top_k": 2**31 - 1,
        "seed": -(2**90),
        "temperature": 1e300,
        "stop_token_ids": [0],
        "logprobs": 20,
    }
    response = httpx.post(url, json=body, timeout=30)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2 and all(choice["finish_reason"] in ("length", "stop") for choice in choices)


@pytest.mark.slow
def test_paired_surrogates_are_text_and_no_request_left_a_traceback(engine: engine_command.EngineProcess) -> None:
    """A surrogate pair is one character (an emoji here): served. After every case above, the log
    holds no traceback (no request reached the tokenizer or the encoder with bad text)."""
    answered = _post(engine, "/v1/completions", b"{" + COMPLETION + b',"prompt":"hi \\ud83d\\ude00"}')
    assert answered.status_code == 200, answered.text
    chat = _post(engine, "/v1/chat/completions", b"{" + CHAT + b'[{"role":"user","content":"\\ud83d\\ude00"}]}')
    assert chat.status_code == 200, chat.text
    assert not [line for line in engine.log if "Traceback" in line], "".join(engine.log[-40:])


@pytest.mark.slow
def test_a_field_name_cannot_forge_or_flood_an_engine_log_line(engine: engine_command.EngineProcess) -> None:
    """Unknown field names are logged (nothing is ignored silently), escaped and cut: a newline,
    carriage return or Unicode line separator in a name stays inside its own line, and a huge name
    does not flood the log."""
    forged = "2026-01-01 00:00:00,000 ERROR megafleet_engine: FORGED"
    names = [f"a\n{forged}", f"b\r{forged}", f"c\u2028{forged}", "d" * 100_000]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, **dict.fromkeys(names, 1)}
    url = f"http://{engine.addresses['frontend']}/v1/completions"
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    lines: list[str] = []

    def logged() -> bool:
        lines[:] = [line for line in engine.log if "ignoring unsupported CompletionRequest fields" in line]
        return any("FORGED" in line for line in lines)

    _wait_for(logged, "the ignored fields in the log")
    assert not [line for line in engine.log if line.startswith(forged) or line.lstrip("\r").startswith(forged)]
    line = next(line for line in lines if "FORGED" in line)
    assert "a\\n2026" in line and "b\\r2026" in line and "c\\u2028" in line
    assert len(line) < 1000, "a 100 000-character name is cut"


def test_printable_escapes_controls_and_cuts() -> None:
    assert protocol.printable("plain text, é ü 日本") == "plain text, é ü 日本"
    assert protocol.printable("a\nb\r\x1b[31m\u2028\x00\ud800") == "a\\nb\\r\\x1b[31m\\u2028\\x00\\ud800"
    assert protocol.printable("x" * 100, limit=10) == "x" * 10 + "..."
    assert protocol.printable("\n" * 100, limit=None) == "\\n" * 100


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_find_lone_surrogate_names_the_path_and_takes_deep_nesting() -> None:
    assert protocol.find_lone_surrogate({"a": ["ok", {"b": "x\udc00"}]}) == "a.1.b"
    assert protocol.find_lone_surrogate({"k\ud800": 1}) == "body"
    assert protocol.find_lone_surrogate({"a": "\U0001f600", "b": ["é", 1, None]}) is None
    deep: object = "\ud800"
    for _ in range(50_000):
        deep = [deep]
    assert protocol.find_lone_surrogate(deep) == ".".join(["0"] * 50_000)


def test_the_api_server_log_formatter_keeps_each_record_on_one_line() -> None:
    formatter = api_server.OneLineFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "field %s", ("a\nERROR forged",), None)
    assert formatter.format(record) == "INFO field a\\nERROR forged"
