"""Several conversations in one request: the ``/v1/chat/completions/batch`` extension renders each
conversation with the chat template, admits all of them as one engine batch and answers one choice
set per conversation (choice ``i * n + k`` is conversation ``i``'s ``k``-th), streaming or not; bad
input is a 4xx with the OpenAI error body naming the conversation at fault. ``/v1/chat/completions``
itself is unchanged (the official ``openai`` client's single-conversation answers are the reference)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from helpers import engine_harness as harness
from megafleet_engine.openai import protocol

PATH = "/v1/chat/completions/batch"
CONVERSATIONS: list[list[ChatCompletionMessageParam]] = [
    [{"role": "system", "content": "You are tiny."}, {"role": "user", "content": "Say something."}],
    [{"role": "user", "content": "Count to three."}],
    [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
]
GOOD: dict[str, Any] = {"model": harness.MODEL, "messages": CONVERSATIONS, "max_tokens": 2}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Served]:
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path_factory.mktemp("chat-batch"))) as running:
        yield running


def _extra(item: Any, name: str) -> Any:
    return (item.model_extra or {}).get(name)


def test_conversations_are_one_batch_answered_like_single_chats(served: harness.Served) -> None:
    sampling: dict[str, Any] = {"max_completion_tokens": 6, "temperature": 0, "logprobs": True}
    with served.openai_client() as client:
        singles = [
            client.chat.completions.create(
                model=harness.MODEL, messages=conversation, extra_body={"return_token_ids": True}, **sampling
            )
            for conversation in CONVERSATIONS
        ]
        batches_before = served.engine.batches
        # the official client's generic POST parses the extension's answer as a plain ChatCompletion
        both = client.post(
            PATH.removeprefix("/v1"),
            cast_to=ChatCompletion,
            body={"model": harness.MODEL, "messages": CONVERSATIONS, "n": 2, "return_token_ids": True, **sampling},
        )
    assert [choice.index for choice in both.choices] == list(range(6))
    single_choices = [single.choices[0] for single in singles]
    expected = [choice for choice in single_choices for _ in range(2)]  # n=2 greedy: both choices alike
    assert [_extra(choice, "token_ids") for choice in both.choices] == [_extra(c, "token_ids") for c in expected]
    assert [choice.message.content for choice in both.choices] == [c.message.content for c in expected]
    prompts = [_extra(choice, "prompt_token_ids") for choice in single_choices]  # each conversation's template
    assert [_extra(choice, "prompt_token_ids") for choice in both.choices] == [p for p in prompts for _ in range(2)]
    assert len(set(map(tuple, prompts))) == len(CONVERSATIONS)
    for choice, single in zip(both.choices, expected, strict=True):
        assert choice.logprobs is not None and single.logprobs is not None and choice.logprobs.content is not None
        assert [entry.token for entry in choice.logprobs.content] == [e.token for e in single.logprobs.content or []]
    # the six sequences reached the idle engine together: one backend batch, no admission
    assert served.engine.batches == batches_before + 1
    assert served.engine.batch_sizes[-1] == 6
    assert both.object == "chat.completion" and _extra(both, "weight_version") == 0
    assert both.usage is not None
    assert both.usage.prompt_tokens == sum(len(prompt) for prompt in prompts)
    assert both.usage.completion_tokens == sum(len(_extra(choice, "token_ids")) for choice in both.choices)


def test_a_batch_streams_every_choice_and_stamps_every_chunk(served: harness.Served) -> None:
    body = {"model": harness.MODEL, "messages": CONVERSATIONS[:2], "max_tokens": 5, "temperature": 0}
    with served.http() as http:
        whole = http.post(PATH, json=body)
        with http.stream("POST", PATH, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["x-megafleet-weight-version"] == "0"
            events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert whole.status_code == 200 and whole.headers["x-megafleet-weight-version"] == "0"
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["weight_version"] == 0 and chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
            if choice.get("finish_reason"):
                finished[choice["index"]] = choice["finish_reason"]
    answers = {choice["index"]: choice for choice in whole.json()["choices"]}
    assert texts == {index: choice["message"]["content"] for index, choice in answers.items()}
    assert finished == {index: choice["finish_reason"] for index, choice in answers.items()}


def _replaced(index: int, conversation: list[Any]) -> list[Any]:
    """:data:`CONVERSATIONS` with conversation ``index`` replaced."""
    return [conversation if position == index else item for position, item in enumerate(CONVERSATIONS)]


TOO_LONG = [{"role": "user", "content": "x" * harness.MAX_SEQUENCE_LENGTH}]

# (id, body changes, status, code, param, words the message must hold)
BAD: list[tuple[str, dict[str, Any], int, str | None, str, str]] = [
    ("empty-list", {"messages": []}, 400, None, "messages", "at least 1"),
    ("empty-conversation", {"messages": _replaced(1, [])}, 400, None, "messages.1", "at least 1"),
    (
        "bad-role",
        {"messages": _replaced(2, [{"role": "robot", "content": "x"}])},
        400,
        None,
        "messages.2.0.role",
        "messages.2.0.role: ",
    ),
    ("one-conversation-not-a-list", {"messages": CONVERSATIONS[0]}, 400, None, "messages.0", "valid list"),
    (
        "conversation-too-long",
        {"messages": _replaced(1, TOO_LONG)},
        400,
        "context_length_exceeded",
        "messages.1",
        "conversation 1",
    ),
    ("conversations-times-n", {"n": 64}, 400, None, "n", "3 conversations x n=64 is 192 sequences"),
    (
        "too-many-conversations",
        {"messages": [CONVERSATIONS[1]] * (protocol.MAX_N + 1)},
        400,
        None,
        "messages",
        "at most",
    ),
    ("unknown-model", {"model": "gpt-9"}, 404, "model_not_found", "model", "gpt-9"),
]


@pytest.mark.parametrize(("changes", "status", "code", "param", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_batch_gets_the_openai_error_body_naming_the_conversation(
    served: harness.Served, changes: dict[str, Any], status: int, code: str | None, param: str, words: str
) -> None:
    with served.http() as http:
        response = http.post(PATH, json={**GOOD, **changes})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["code"], error["param"]) == (code, param), error
        assert words in error["message"], error
        assert response.json()["weight_version"] == 0
        good = http.post(PATH, json=GOOD)
        assert good.status_code == 200 and len(good.json()["choices"]) == len(CONVERSATIONS)
