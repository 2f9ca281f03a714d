"""Version spans: which weight version produced which generated tokens of a choice.

The engine cannot change its version while a sequence runs yet (refits drain or abort), so the
steps here are synthetic: a scripted client pushes steps stamped with two versions into a real
:class:`~megafleet_engine.openai.engine_client.Batch`, and the real serving classes answer from it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest

from megafleet_engine.backends import base
from megafleet_engine.openai import engine_client, protocol, serving, version_spans
from megafleet_protocol import vocabulary

Span = version_spans.Span


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        ([], ()),
        ([3], (Span(0, 3),)),
        ([3, 3, 3, 3], (Span(0, 3),)),
        ([None, None], (Span(0, None),)),
        ([3, 4, 4], (Span(0, 3), Span(1, 4))),  # the switch right after the first token
        ([3, 3, 3, 4, 4], (Span(0, 3), Span(3, 4))),  # mid-sequence
        ([3, 3, 4, 4, 5], (Span(0, 3), Span(2, 4), Span(4, 5))),  # twice
        ([3, 4, 3], (Span(0, 3), Span(1, 4), Span(2, 3))),  # a version is whatever the step says
    ],
)
def test_spans_of_tokens_versions(versions: list[int | None], expected: tuple[Span, ...]) -> None:
    assert version_spans.spans_of(versions) == expected


def test_spans_count_whole_steps() -> None:
    spans = version_spans.VersionSpans()
    spans.add(7, 2)
    spans.add(7, 0)  # nothing: no span
    spans.add(8, 0)
    spans.add(8, 3)
    assert spans.spans == (Span(0, 7), Span(2, 8)) and spans.tokens == 5


def _step(index: int, token: int, finish: base.FinishReason | None = None) -> engine_client.StepItem:
    return index, base.TokenStep(f"r-{index}", token, None, finish_reason=finish)


async def _drain(batch: engine_client.Batch) -> list[tuple[int | None, list[tuple[int, int]]]]:
    """Every ``next`` of ``batch``: the version, and (index, token) of what it returned."""
    out: list[tuple[int | None, list[tuple[int, int]]]] = []
    while (tokens := await batch.next()) is not None:
        out.append((batch.version, [(index, step.token_id) for index, step in tokens]))
    return out


def test_batch_never_returns_two_versions_at_once() -> None:
    async def run() -> None:
        batch = engine_client.Batch(2, lambda indexes: None)
        batch.push([_step(0, 10), _step(1, 20)], 1)
        batch.push([_step(0, 11), _step(1, 21)], 1)  # queued with the first: returned together
        batch.push([_step(0, 12)], 2)  # a switch: split here
        batch.push([_step(0, 13, "length"), _step(1, 22, "length")], 2)
        assert await _drain(batch) == [
            (1, [(0, 10), (1, 20), (0, 11), (1, 21)]),
            (2, [(0, 12), (0, 13), (1, 22)]),
        ]
        assert batch.weight_version == 1
        assert batch.spans(0) == (Span(0, 1), Span(2, 2))
        assert batch.spans(1) == (Span(0, 1), Span(2, 2))

    asyncio.run(run())


def test_a_later_span_says_how_the_kv_crossed_its_switch() -> None:
    async def run() -> None:
        batch = engine_client.Batch(2, lambda indexes: None)
        batch.push([_step(0, 10), _step(1, 20)], 1)  # the first span never has one
        batch.push([_step(0, 11)], 2, "recompute")  # a refit kept sequence 0 and recomputed its KV
        batch.push([_step(0, 12), _step(1, 21, "length")], 2, "recompute")
        batch.push([_step(0, 13, "length")], 3, "persist")
        await _drain(batch)
        assert batch.spans(0) == (Span(0, 1), Span(1, 2, "recompute"), Span(3, 3, "persist"))
        assert batch.spans(1) == (Span(0, 1), Span(1, 2, "recompute"))

    asyncio.run(run())


def test_batch_spans_count_only_the_tokens_it_returned() -> None:
    async def run() -> None:
        batch = engine_client.Batch(2, lambda indexes: None)
        batch.push([_step(0, 10), _step(1, 20)], 4)
        assert await batch.next() is not None
        batch.stop(1)  # its stop string matched: what it still had in flight is dropped
        batch.push([_step(0, 11), _step(1, 21)], 5)
        batch.push([_step(0, 12, "stop")], 5)
        assert await _drain(batch) == [(5, [(0, 11), (0, 12)])]
        assert batch.spans(0) == (Span(0, 4), Span(1, 5))
        assert batch.spans(1) == (Span(0, 4),)

    asyncio.run(run())


# -- serving: responses and streams from synthetic steps ---------------------------------------------

INFO = base.ModelInfo(name="tiny", max_sequence_length=64, vocab_size=100, eos_token_id=None)


class _NoText:
    """A tokenizer these requests never use (token ids in, token ids out)."""

    def encode(self, text: str) -> list[int]:
        raise AssertionError("encode")

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        raise AssertionError("decode")

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any:
        raise AssertionError("apply_chat_template")


class _Metrics:
    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        pass

    def observe_first_token(self, seconds: float) -> None:
        pass

    def count_prompt_tokens(self, count: int) -> None:
        pass


class _Scripted:
    """An engine client whose batches receive ``steps`` (each: version, (choice, token, finish)...)."""

    def __init__(self, steps: Sequence[tuple[int, Sequence[tuple[int, int, base.FinishReason | None]]]]) -> None:
        self._steps = steps

    @property
    def info(self) -> base.ModelInfo:
        return INFO

    @property
    def weight_version(self) -> int | None:
        return self._steps[-1][0]

    @property
    def state(self) -> vocabulary.EngineState:
        return "ready"

    @property
    def accepting(self) -> bool:
        return True

    async def submit(self, requests: Sequence[base.SequenceRequest]) -> engine_client.Batch:
        batch = engine_client.Batch(len(requests), lambda indexes: None)
        loop = asyncio.get_running_loop()
        for version, tokens in self._steps:
            loop.call_soon(batch.push, [_step(index, token, finish) for index, token, finish in tokens], version)
        return batch


# two choices; versions 1, 1, 2 for choice 0 (switch mid-sequence), 2 for all of choice 1's tokens
STEPS: list[tuple[int, list[tuple[int, int, base.FinishReason | None]]]] = [
    (1, [(0, 10, None)]),
    (1, [(0, 11, None)]),
    (2, [(0, 12, "length"), (1, 20, None)]),
    (2, [(1, 21, None)]),
    (2, [(1, 22, "length")]),
]
SPANS = {0: [{"start": 0, "version": 1}, {"start": 2, "version": 2}], 1: [{"start": 0, "version": 2}]}


def _context() -> serving.ServingContext:
    return serving.ServingContext(_Scripted(STEPS), _NoText(), _Metrics())


def _completion(stream: bool) -> protocol.CompletionRequest:
    return protocol.CompletionRequest(
        model="tiny", prompt=[[1, 2], [3]], max_tokens=3, detokenize=False, stream=stream, temperature=0
    )


def _chat(stream: bool) -> protocol.ChatBatchRequest:
    return protocol.ChatBatchRequest(
        model="tiny",
        messages=[[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
        max_tokens=3,
        detokenize=False,
        stream=stream,
    )


def test_completion_choices_carry_their_spans() -> None:
    response = asyncio.run(serving.CompletionServing(_context()).create(_completion(stream=False)))
    body = protocol.dump(response)
    assert body["weight_version"] == 1  # the first tokens' version, as before
    assert {choice["index"]: choice["weight_version_spans"] for choice in body["choices"]} == SPANS
    assert [choice["token_ids"] for choice in body["choices"]] == [[10, 11, 12], [20, 21, 22]]


def test_chat_choices_carry_their_spans() -> None:
    class Chat(serving.ChatServing):
        def _render(self, conversation: list[dict[str, str]], index: int | None) -> list[int]:
            return [1, 2]  # no tokenizer here: the template is not what this test is about

    response = asyncio.run(Chat(_context()).create(_chat(stream=False)))
    body = protocol.dump(response)
    assert body["weight_version"] == 1
    assert {choice["index"]: choice["weight_version_spans"] for choice in body["choices"]} == SPANS


async def _events(stream: serving.Stream) -> list[dict[str, Any]]:
    events = []
    async for chunk in stream.events:
        for line in chunk.decode().split("\n\n"):
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def _check_stream(events: list[dict[str, Any]]) -> None:
    """Each streamed choice's tokens have the version it says; the last one carries the spans."""
    versions: dict[int, list[int]] = {0: [], 1: []}
    finals = {}
    for event in events:
        assert event["weight_version"] == 1  # the envelope's: the stream's first tokens'
        for choice in event["choices"]:
            tokens = choice.get("token_ids") or []
            if tokens:
                versions[choice["index"]] += [choice["weight_version"]] * len(tokens)
            if choice.get("finish_reason"):
                finals[choice["index"]] = choice["weight_version_spans"]
            else:
                assert "weight_version_spans" not in choice
    assert versions == {0: [1, 1, 2], 1: [2, 2, 2]}
    assert finals == SPANS


def test_completion_stream_splits_at_a_switch() -> None:
    async def run() -> list[dict[str, Any]]:
        stream = await serving.CompletionServing(_context()).stream(_completion(stream=True))
        assert stream.weight_version == 1
        return await _events(stream)

    _check_stream(asyncio.run(run()))


def test_chat_stream_splits_at_a_switch() -> None:
    class Chat(serving.ChatServing):
        def _render(self, conversation: list[dict[str, str]], index: int | None) -> list[int]:
            return [1, 2]

    async def run() -> list[dict[str, Any]]:
        return await _events(await Chat(_context()).stream(_chat(stream=True)))

    _check_stream(asyncio.run(run()))
