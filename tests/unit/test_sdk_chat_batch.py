"""How the SDK sends a chat batch: batched requests to ``/v1/chat/completions/batch``, one per
frontend per chunk (never one per conversation), answers back in conversation order with the weight
version each frontend stamped; a 5xx fails over to the next frontend and a 4xx fails at once.
Frontends are an in-process fake (httpx's mock transport) that answers the way the engine does
(choice ``i`` is conversation ``i``'s); the real engine's side is ``tests/sdk/test_sdk_generation.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from megafleet.sdk import errors, generation, routing
from megafleet_protocol import frontend as limits

URLS = ("http://127.0.9.1:8000/v1", "http://127.0.9.2:8000/v1")
VERSIONS = {URLS[0]: 3, URLS[1]: 4}  # each fake frontend stamps its own, so answers show who served them


class Frontends:
    """Fake frontends: every request they got; ``status``: what they answer (200 echoes the batch)."""

    def __init__(self, status: dict[str, int] | None = None) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.status = status or {}

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = next(url for url in URLS if str(request.url).startswith(url))
        body = json.loads(request.content)
        self.requests.append((str(request.url).removeprefix(base), body))
        status = self.status.get(base, 200)
        if status != 200:
            error = {"message": "no", "type": "invalid_request_error", "param": "messages.1", "code": None}
            return httpx.Response(status, json={"error": error})
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": conversation[-1]["content"].upper()},
                "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120]}]},
                "finish_reason": "length",
                "token_ids": [index],
                "prompt_token_ids": [1, 2],
            }
            for index, conversation in enumerate(body["messages"])
        ]
        choices.reverse()  # the SDK must order by index, not by position
        stamped = {"object": "chat.completion", "choices": choices, "weight_version": VERSIONS[base]}
        return httpx.Response(200, json=stamped)


def _chat_batch(fake: Frontends, conversations: list[list[dict[str, str]]]) -> list[generation.Answer]:
    router = routing.Router([routing.Frontend(shard, url, None) for shard, url in enumerate(URLS)])

    async def run() -> list[generation.Answer]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake.handle)) as http:
            generator = generation.Generator(router, model="tiny", http=http)
            return await generator.chat_batch(conversations, generation.Sampling(max_tokens=4, temperature=0))

    return asyncio.run(run())


def _conversations(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}] for i in range(count)]


@pytest.mark.parametrize(
    ("count", "requests"),
    [(2, 2), (16, 2), (2 * limits.MAX_SEQUENCES_PER_REQUEST + 1, 3)],
    ids=["one-each", "one-per-frontend", "over-the-bound"],
)
def test_one_batched_request_per_frontend_per_chunk_answers_in_order(count: int, requests: int) -> None:
    fake = Frontends()
    conversations = _conversations(count)

    answers = _chat_batch(fake, conversations)

    assert len(fake.requests) == requests  # not one per conversation
    assert {path for path, _ in fake.requests} == {"/chat/completions/batch"}
    sent = [conversation for _, body in fake.requests for conversation in body["messages"]]
    assert sorted(sent, key=lambda c: int(c[1]["content"][1:])) == conversations  # each sent once, whole
    assert all(len(body["messages"]) <= limits.MAX_SEQUENCES_PER_REQUEST for _, body in fake.requests)
    first = fake.requests[0][1]
    assert (first["model"], first["max_tokens"], first["temperature"]) == ("tiny", 4, 0)
    assert first["return_token_ids"] is True and first["logprobs"] is True
    assert [answer.text for answer in answers] == [f"Q{i}" for i in range(count)]
    assert {answer.url for answer in answers} == set(URLS)  # spread over both frontends
    for answer in answers:
        assert answer.weight_version == VERSIONS[answer.url]
        assert answer.logprobs == [-0.5] and answer.finish_reason == "length"


def test_an_empty_batch_sends_nothing() -> None:
    fake = Frontends()
    assert _chat_batch(fake, []) == []
    assert fake.requests == []


def test_a_frontend_that_fails_is_skipped_and_a_bad_batch_fails_at_once() -> None:
    failing = Frontends({URLS[0]: 503})
    answers = _chat_batch(failing, _conversations(4))
    assert {answer.url for answer in answers} == {URLS[1]}
    assert [answer.text for answer in answers] == ["Q0", "Q1", "Q2", "Q3"]

    refused = Frontends({URLS[0]: 400, URLS[1]: 400})
    with pytest.raises(errors.GenerationFailed, match="HTTP 400"):
        _chat_batch(refused, _conversations(4))
    assert len(refused.requests) <= 2  # each chunk tried once: a 4xx is the request's own fault
