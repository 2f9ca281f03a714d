"""Version spans in the SDK: an answer says which of its tokens came from which weight version, and
the NeMo RL adapter's outputs carry it per token, aligned like the log-probabilities.

The engine cannot change its version mid-sequence yet (refits drain or abort), so answers spanning
two versions come from a frontend on ``httpx.MockTransport``; the engine's own spans (one per
answer today) are checked against real engines in ``test_sdk_generation.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import torch

from megafleet.sdk import generation, nemo, routing

VersionSpan = generation.VersionSpan
URL = "http://f0/v1"


def answer(tokens: int, version: int | None, spans: tuple[VersionSpan, ...]) -> generation.Answer:
    return generation.Answer("", list(range(tokens)), None, None, "length", version, URL, 0, spans)


@pytest.mark.parametrize(
    ("tokens", "version", "spans", "per_token", "last"),
    [
        (3, 4, (), [4, 4, 4], 4),  # an engine that gives no spans: all its weight_version
        (3, None, (), [None, None, None], None),
        (3, 4, (VersionSpan(0, 4),), [4, 4, 4], 4),
        (4, 4, (VersionSpan(0, 4), VersionSpan(1, 5)), [4, 5, 5, 5], 5),  # switch after the first token
        (5, 4, (VersionSpan(0, 4), VersionSpan(3, 5)), [4, 4, 4, 5, 5], 5),  # mid-sequence
        (5, 4, (VersionSpan(0, 4), VersionSpan(2, 5), VersionSpan(4, 6)), [4, 4, 5, 5, 6], 6),  # twice
        (0, 4, (), [], 4),
    ],
)
def test_each_token_has_the_version_of_its_span(
    tokens: int, version: int | None, spans: tuple[VersionSpan, ...], per_token: list[int | None], last: int | None
) -> None:
    one = answer(tokens, version, spans)
    assert one.token_weight_versions == per_token
    assert one.last_weight_version == last
    assert one.weight_version == version  # unchanged: the first tokens'


def _frontend(request: httpx.Request) -> httpx.Response:
    """Two choices: the first spans versions 4 and 5, the second (an older engine) gives no spans."""
    body = json.loads(request.content)
    spans = [{"start": 0, "version": 4}, {"start": 2, "version": 5}]
    first: dict[str, Any] = {"index": 0, "token_ids": [7, 8, 9], "finish_reason": "length"}
    second: dict[str, Any] = {"index": 1, "token_ids": [7, 8, 9], "finish_reason": "length"}
    first["weight_version_spans"] = spans
    if "messages" in body:
        first["message"] = second["message"] = {"role": "assistant", "content": ""}
    else:
        first["text"] = second["text"] = ""
    return httpx.Response(200, json={"choices": [second, first], "weight_version": 4})


def _answers(chat: bool) -> list[generation.Answer]:
    async def run() -> list[generation.Answer]:
        router = routing.Router([routing.Frontend(0, URL, 0)])
        http = httpx.AsyncClient(transport=httpx.MockTransport(_frontend))
        sampling = generation.Sampling(max_tokens=3, logprobs=False)
        async with http, generation.Generator(router, model="m", http=http, max_sequence_length=64) as generator:
            if chat:
                return await generator.chat_batch([[{"role": "user", "content": "a"}]] * 2, sampling)
            return await generator.complete_batch([[1, 2], [3]], sampling)

    return asyncio.run(run())


@pytest.mark.parametrize("chat", [False, True])
def test_answers_parse_the_spans_of_their_choice(chat: bool) -> None:
    spanning, plain = _answers(chat)
    assert spanning.weight_version_spans == (VersionSpan(0, 4), VersionSpan(2, 5))
    assert (spanning.weight_version, spanning.last_weight_version) == (4, 5)
    assert plain.weight_version_spans == () and plain.last_weight_version == 4


def test_nemo_outputs_carry_each_tokens_version_where_its_logprob_is() -> None:
    input_ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [4, 0, 0, 0]])
    input_lengths = torch.tensor([3, 2, 1])
    answers = [
        generation.Answer("", [11, 12], [-0.5, -0.25], None, "length", 4, URL, 0, (VersionSpan(0, 4),)),
        generation.Answer(
            "", [13, 14, 15], [-1.0, -2.0, -3.0], None, "stop", 4, URL, 0, (VersionSpan(0, 4), VersionSpan(1, 5))
        ),
        generation.Answer("", [16], [-1.5], None, "stop", None, URL, 0),  # no version, no spans
    ]
    out = nemo.pack_outputs(input_ids, input_lengths, answers, pad_token_id=0)
    assert out["weight_versions"].tolist() == [4, 4, -1]
    assert out["last_weight_versions"].tolist() == [4, 5, -1]
    assert out["last_weight_versions"].dtype == torch.long
    versions = out["token_weight_versions"]
    assert versions.dtype == torch.long and versions.shape == out["logprobs"].shape == (3, 7)
    assert versions.tolist() == [
        [-1, -1, -1, 4, 4, -1, -1],
        [-1, -1, 4, 5, 5, -1, -1],
        [-1, -1, -1, -1, -1, -1, -1],
    ]
    # exactly where the log-probabilities of generated tokens are
    known = [answer for answer in answers if answer.weight_version is not None]
    assert ((versions[: len(known)] >= 0) == (out["logprobs"][: len(known)] != 0)).all()
