"""The OpenAI-compatible frontend through the official ``openai`` client, against the tiny model on a
real HTTP server: completions and chat, streaming and not, n > 1, log-probabilities and token ids,
the weight version on every response, greedy equality with ``model.generate``, stop strings and
batching of concurrent requests."""

from __future__ import annotations

import json
import math
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

from helpers import engine_harness as harness

pytestmark = pytest.mark.slow  # each test starts an engine, a server, Ray or a subprocess, or computes for a while

WEIGHT_HEADER = "x-megafleet-weight-version"
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are tiny."},
    {"role": "user", "content": "Say something."},
]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.Served]:
    """A ready engine serving weight version 0, no API key."""
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path)) as running:
        yield running


def _greedy(served: harness.Served, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The tiny model's own greedy continuation."""
    inputs = torch.tensor([prompt_ids])
    with torch.inference_mode():
        output = served.backend.model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens
        )
    return [int(token) for token in output[0, len(prompt_ids) :]]


def _extra(item: Any, name: str) -> Any:
    """An extension field the client keeps as an extra attribute."""
    return (item.model_extra or {}).get(name)


def test_models_lists_the_served_model_with_weight_version(served: harness.Served) -> None:
    with served.openai_client() as client:
        raw = client.models.with_raw_response.list()
        one = client.models.with_raw_response.retrieve(harness.MODEL)
    models = raw.parse()
    assert [model.id for model in models.data] == [harness.MODEL]
    assert raw.headers[WEIGHT_HEADER] == "0"
    assert _extra(models, "weight_version") == 0
    assert one.parse().id == harness.MODEL and one.headers[WEIGHT_HEADER] == "0"


def test_extreme_sampling_values_do_not_break_generation(served: harness.Served) -> None:
    """Values at the edges of what is valid must not fail the batch they share with others."""
    with served.openai_client() as client:
        completion = client.completions.create(
            model=harness.MODEL,
            prompt="abc",
            n=2,
            max_tokens=4,
            temperature=1e-300,  # greedy: dividing the logits by it would overflow
            seed=2**70,  # beyond a torch generator's 64 bits
            extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 10**9},
        )
    assert [len(_extra(choice, "token_ids")) for choice in completion.choices] == [4, 4]


def test_completion_greedy_equals_model_generate(served: harness.Served) -> None:
    prompt_ids = served.backend.tokenizer.encode("Hello world")
    with served.openai_client() as client:
        raw = client.completions.with_raw_response.create(
            model=harness.MODEL,
            prompt="Hello world",
            max_tokens=24,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
    completion = raw.parse()
    choice = completion.choices[0]
    expected = _greedy(served, prompt_ids, 24)
    assert _extra(choice, "prompt_token_ids") == prompt_ids
    assert _extra(choice, "token_ids") == expected
    assert choice.text == served.backend.tokenizer.decode(expected, skip_special_tokens=True)
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(prompt_ids), len(expected))
    assert raw.headers[WEIGHT_HEADER] == "0" and _extra(completion, "weight_version") == 0


def test_chat_greedy_equals_model_generate_on_the_chat_template(served: harness.Served) -> None:
    tokenizer = served.backend.tokenizer
    prompt_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    with served.openai_client() as client:
        raw = client.chat.completions.with_raw_response.create(
            model=harness.MODEL,
            messages=CHAT,
            max_completion_tokens=20,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
    chat = raw.parse()
    expected = _greedy(served, prompt_ids, 20)
    choice = chat.choices[0]
    assert _extra(choice, "prompt_token_ids") == prompt_ids
    assert _extra(choice, "token_ids") == expected
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert raw.headers[WEIGHT_HEADER] == "0" and _extra(chat, "weight_version") == 0


def test_completion_accepts_token_ids_and_several_prompts(served: harness.Served) -> None:
    tokenizer = served.backend.tokenizer
    first, second = tokenizer.encode("abc"), tokenizer.encode("xyz")
    with served.openai_client() as client:
        single = client.completions.create(
            model=harness.MODEL, prompt=first, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
        )
        several = client.completions.create(
            model=harness.MODEL,
            prompt=["abc", second],
            max_tokens=4,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
    assert _extra(single.choices[0], "token_ids") == _greedy(served, first, 4)
    assert [choice.index for choice in several.choices] == [0, 1]
    assert [_extra(choice, "prompt_token_ids") for choice in several.choices] == [first, second]
    assert _extra(several.choices[1], "token_ids") == _greedy(served, second, 4)


def test_n_choices_with_logprobs_and_token_ids(served: harness.Served) -> None:
    with served.openai_client() as client:
        chat = client.chat.completions.create(
            model=harness.MODEL,
            messages=CHAT,
            n=3,
            max_tokens=6,
            temperature=1.0,
            seed=7,
            logprobs=True,
            top_logprobs=2,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        again = client.chat.completions.create(
            model=harness.MODEL,
            messages=CHAT,
            n=3,
            max_tokens=6,
            temperature=1.0,
            seed=7,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    assert [choice.index for choice in chat.choices] == [0, 1, 2]
    token_ids = [_extra(choice, "token_ids") for choice in chat.choices]
    assert all(len(ids) == 6 for ids in token_ids)
    assert len({tuple(ids) for ids in token_ids}) > 1, "seeded choices should differ from each other"
    assert [_extra(choice, "token_ids") for choice in again.choices] == token_ids, "the same seed reproduces"
    for choice, ids in zip(chat.choices, token_ids, strict=True):
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
        assert len(entries) == len(ids)
        assert all(entry.logprob <= 0.0 and len(entry.top_logprobs) == 2 for entry in entries)
    assert chat.usage is not None and chat.usage.completion_tokens == 18


def test_completion_logprobs_match_the_tokens(served: harness.Served) -> None:
    with served.openai_client() as client:
        completion = client.completions.create(
            model=harness.MODEL,
            prompt="abc",
            max_tokens=5,
            temperature=0,
            logprobs=3,
            extra_body={"return_token_ids": True},
        )
    choice = completion.choices[0]
    assert choice.logprobs is not None
    ids = _extra(choice, "token_ids")
    assert choice.logprobs.tokens == [served.backend.tokenizer.decode([token]) for token in ids]
    assert choice.logprobs.token_logprobs is not None and len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.top_logprobs is not None
    for logprob, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True):
        assert logprob is not None and logprob <= 0.0
        assert max(top.values()) == logprob, "greedy picks the most likely token"


def test_chat_stream_matches_non_streaming_and_stamps_every_chunk(served: harness.Served) -> None:
    with served.openai_client() as client:
        whole = client.chat.completions.create(
            model=harness.MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
        )
        raw = client.chat.completions.with_raw_response.create(
            model=harness.MODEL,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
        assert raw.headers[WEIGHT_HEADER] == "0"
        chunks = list(raw.parse())
    assert all(_extra(chunk, "weight_version") == 0 for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    ids = [token for chunk in chunks if chunk.choices for token in (_extra(chunk.choices[0], "token_ids") or [])]
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert ids == _extra(whole.choices[0], "token_ids")
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)


def test_completion_stream_with_n_and_logprobs(served: harness.Served) -> None:
    with served.openai_client() as client:
        stream = client.completions.create(
            model=harness.MODEL,
            prompt="abc",
            n=2,
            max_tokens=5,
            temperature=0,
            logprobs=1,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        with stream:
            chunks = list(stream)
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[float | None]] = {0: [], 1: []}
    for chunk in chunks:
        assert _extra(chunk, "weight_version") == 0
        for choice in chunk.choices:
            per_choice[choice.index] += _extra(choice, "token_ids") or []
            assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
            logprobs[choice.index] += choice.logprobs.token_logprobs
    assert per_choice[0] == per_choice[1] and len(per_choice[0]) == 5, "greedy choices are identical"
    assert len(logprobs[0]) == 5 and all(value is not None for value in logprobs[0])


def test_streamed_chunks_carry_what_the_whole_response_carries(served: harness.Served) -> None:
    """Streamed choices are built without the response models (``sse_frames.Frame``): each choice's
    prompt ids come once, in its first chunk, and its log-probabilities (tokens, values,
    alternatives) add up to the non-streaming response's; a chat stream opens each choice with its
    prompt ids."""
    body = {"ignore_eos": True, "return_token_ids": True}
    with served.openai_client() as client:
        whole = client.completions.create(
            model=harness.MODEL, prompt="abc", n=2, max_tokens=6, temperature=0, logprobs=2, extra_body=body
        )
        stream = client.completions.create(
            model=harness.MODEL,
            prompt="abc",
            n=2,
            max_tokens=6,
            temperature=0,
            logprobs=2,
            stream=True,
            extra_body=body,
        )
        with stream:
            chunks = list(stream)
        chat_whole = client.chat.completions.create(
            model=harness.MODEL, messages=CHAT, max_tokens=4, temperature=0, extra_body=body
        )
        chat_stream = client.chat.completions.create(
            model=harness.MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True, extra_body=body
        )
        with chat_stream:
            chat_chunks = list(chat_stream)
    for expected in whole.choices:
        mine = [choice for chunk in chunks for choice in chunk.choices if choice.index == expected.index]
        prompt_ids = [_extra(choice, "prompt_token_ids") for choice in mine]
        assert prompt_ids[0] == _extra(expected, "prompt_token_ids") and not any(prompt_ids[1:])
        assert [token for choice in mine for token in _extra(choice, "token_ids")] == _extra(expected, "token_ids")
        assert "".join(choice.text for choice in mine) == expected.text
        assert expected.logprobs is not None
        for field in ("tokens", "token_logprobs", "top_logprobs"):
            streamed = [value for choice in mine for value in getattr(choice.logprobs, field)]
            assert streamed == getattr(expected.logprobs, field), field
        # a stream's offsets are positions in the text emitted so far (a token whose character is
        # not complete yet sits where the text ends), the whole response's add the tokens' lengths
        offsets = [value for choice in mine if choice.logprobs for value in choice.logprobs.text_offset or []]
        assert len(offsets) == 6 and offsets == sorted(offsets) and offsets[-1] <= len(expected.text)
    opening = chat_chunks[0].choices[0]
    assert opening.delta.role == "assistant"
    assert _extra(opening, "prompt_token_ids") == _extra(chat_whole.choices[0], "prompt_token_ids")
    assert not any(_extra(choice, "prompt_token_ids") for chunk in chat_chunks[1:] for choice in chunk.choices)


def test_every_choice_carries_its_version_spans(served: harness.Served) -> None:
    """One version throughout: every choice, whole or streamed, has one span from its first token at
    the response's ``weight_version``; each streamed choice with tokens carries their version, and the
    chunk that finishes a choice carries its spans."""
    one_span = [{"start": 0, "version": 0}]
    body = {"ignore_eos": True, "return_token_ids": True}
    with served.openai_client() as client:
        completion = client.completions.create(
            model=harness.MODEL, prompt=["abc", "Hello"], n=2, max_tokens=5, temperature=1.0, seed=3, extra_body=body
        )
        chat = client.chat.completions.create(model=harness.MODEL, messages=CHAT, max_tokens=5, extra_body=body)
        stream = client.completions.create(
            model=harness.MODEL, prompt="abc", n=2, max_tokens=5, stream=True, extra_body=body
        )
        with stream:
            chunks = [choice for chunk in stream for choice in chunk.choices]
        chat_stream = client.chat.completions.create(
            model=harness.MODEL, messages=CHAT, max_tokens=5, stream=True, extra_body=body
        )
        with chat_stream:
            chat_chunks = [choice for chunk in chat_stream for choice in chunk.choices]
    assert _extra(completion, "weight_version") == 0 and _extra(chat, "weight_version") == 0
    for choice in [*completion.choices, *chat.choices]:
        assert len(_extra(choice, "token_ids")) == 5
        assert _extra(choice, "weight_version_spans") == one_span
    for streamed in (chunks, chat_chunks):
        with_tokens = [choice for choice in streamed if _extra(choice, "token_ids")]
        assert with_tokens and all(_extra(choice, "weight_version") == 0 for choice in with_tokens)
        finals = [_extra(choice, "weight_version_spans") for choice in streamed if choice.finish_reason]
        assert finals == [one_span] * len({choice.index for choice in streamed})
        assert not any(_extra(choice, "weight_version_spans") for choice in streamed if not choice.finish_reason)


def test_stop_string_ends_the_choice_before_the_stop(served: harness.Served) -> None:
    with served.openai_client() as client:
        free = client.completions.create(model=harness.MODEL, prompt="Hello world", max_tokens=30, temperature=0)
        text = free.choices[0].text
        stop = _ascii_pair(text)
        stopped = client.completions.create(
            model=harness.MODEL, prompt="Hello world", max_tokens=30, temperature=0, stop=[stop]
        )
        stream = client.completions.create(
            model=harness.MODEL, prompt="Hello world", max_tokens=30, temperature=0, stop=stop, stream=True
        )
        with stream:
            streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert streamed == text[: text.index(stop)]


def _ascii_pair(text: str) -> str:
    """The first two adjacent printable ASCII characters of ``text`` that start after position 2."""
    for start in range(3, len(text) - 1):
        pair = text[start : start + 2]
        if all(33 <= ord(char) < 127 for char in pair):
            return pair
    raise AssertionError(f"no ASCII pair in {text!r}")


def test_concurrent_requests_complete_and_are_batched(served: harness.Served) -> None:
    count = 8
    barrier = threading.Barrier(count)
    results: list[str | None] = [None] * count
    errors: list[BaseException] = []

    def ask(index: int) -> None:
        try:
            with served.openai_client() as client:
                barrier.wait(timeout=30)
                chat = client.chat.completions.create(
                    model=harness.MODEL, messages=CHAT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
                )
            results[index] = chat.choices[0].finish_reason
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert results == ["length"] * count
    assert max(served.engine.batch_sizes) > 1, f"never batched: {served.engine.batch_sizes}"


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_cancels_generation(served: harness.Served, stream: bool) -> None:
    produced: dict[str, int] = {}
    generating = threading.Event()
    original = served.backend.generate

    def counting(batch: Any, admit: Any = None) -> Any:
        for steps in original(batch, admit):
            for step in steps:
                produced[step.request_id] = produced.get(step.request_id, 0) + 1
            generating.set()
            yield steps

    served.backend.generate = counting  # type: ignore[method-assign]
    try:
        body = json.dumps(
            {"model": harness.MODEL, "prompt": "abc", "max_tokens": 240, "stream": stream, "ignore_eos": True}
        )
        host, port = served.servers.address("frontend").rsplit(":", 1)  # type: ignore[union-attr]
        with socket.create_connection((host, int(port)), timeout=30) as client:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
            assert generating.wait(timeout=30)
        # the client has hung up after the first step; 240 steps take far longer than noticing that
        with served.agent() as agent:  # a drain returns once nothing is in flight
            assert agent.post("/v1/suspend", json={"mode": "drain", "timeoutSeconds": 30}).status_code == 200
            assert agent.post("/v1/resume", json={}).json()["state"] == "ready"
    finally:
        del served.backend.generate
    assert len(produced) == 1
    assert next(iter(produced.values())) < 240, "the engine kept generating for a client that left"


def test_openai_client_error_types(served: harness.Served) -> None:
    with served.openai_client() as client:
        try:
            client.completions.create(model="other", prompt="x")
        except openai.NotFoundError as error:
            assert error.code == "model_not_found"
        else:
            raise AssertionError("an unknown model must be refused")


def test_logprobs_mode_selects_processed_or_raw_logprobs(served: harness.Served) -> None:
    """Default ``processed_logprobs``: the distribution tokens were drawn from (top_k 3 cuts the
    4th and 5th alternatives, shown as -9999.0, the floor JSON can carry); ``raw_logprobs``:
    ``log_softmax`` of the logits. The mode never changes the tokens."""
    answers = {}
    with served.openai_client() as client:
        for mode in (None, "raw_logprobs"):
            answers[mode] = client.chat.completions.create(
                model=harness.MODEL,
                messages=CHAT,
                max_tokens=6,
                temperature=0.7,
                seed=3,
                logprobs=True,
                top_logprobs=5,
                extra_body={"top_k": 3, "ignore_eos": True, **({"logprobs_mode": mode} if mode else {})},
            )
    processed, raw = (answers[mode].choices[0].logprobs for mode in (None, "raw_logprobs"))
    assert processed is not None and processed.content is not None and raw is not None and raw.content is not None
    assert [entry.token for entry in processed.content] == [entry.token for entry in raw.content]
    for cut, full in zip(processed.content, raw.content, strict=True):
        assert [top.logprob for top in cut.top_logprobs][3:] == [-9999.0, -9999.0]
        assert sum(math.exp(top.logprob) for top in cut.top_logprobs) == pytest.approx(1.0, abs=1e-4)
        assert cut.logprob > full.logprob > -9999.0
        assert all(top.logprob > -9999.0 for top in full.top_logprobs)
