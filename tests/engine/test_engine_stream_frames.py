"""A streamed chunk framed once per stream (``sse_frames.Frame``) says exactly what the chunk model
dumped per token said: the fast path must not change a byte a client parses."""

from __future__ import annotations

import json

import pytest

from megafleet_engine.openai import protocol, sse_frames


def parsed(event: bytes) -> dict[str, object]:
    text = event.decode()
    assert text.startswith("data: ") and text.endswith("\n\n")
    value = json.loads(text[len("data: ") : -2])
    assert isinstance(value, dict)
    return value


COMPLETION_CHOICES = [
    protocol.CompletionChoice(index=0, text=" hello"),
    protocol.CompletionChoice(index=3, text="", finish_reason="length", token_ids=[7]),
    protocol.CompletionChoice(index=1, text='é ✓ "quoted" \\ \n', token_ids=[1, 2], prompt_token_ids=[5, 6]),
    protocol.CompletionChoice(
        index=0,
        text="a",
        logprobs=protocol.CompletionLogprobs(
            tokens=["a"], token_logprobs=[-0.25], top_logprobs=[{"a": -0.25, "b": -9999.0}], text_offset=[4]
        ),
        finish_reason="stop",
    ),
]

CHAT_CHOICES = [
    protocol.ChatStreamChoice(index=0, delta=protocol.DeltaMessage(role="assistant", content="")),
    protocol.ChatStreamChoice(index=2, delta=protocol.DeltaMessage(role="assistant", content=""), prompt_token_ids=[9]),
    protocol.ChatStreamChoice(
        index=1, delta=protocol.DeltaMessage(content="日本"), token_ids=[3], finish_reason="length"
    ),
    protocol.ChatStreamChoice(
        index=0,
        delta=protocol.DeltaMessage(content="x"),
        logprobs=protocol.ChatLogprobs(
            content=[
                protocol.TokenLogprob(
                    token="x",
                    logprob=-1.5,
                    bytes=[120],
                    top_logprobs=[protocol.TopLogprob(token="y", logprob=-2.0, bytes=[121])],
                )
            ]
        ),
    ),
]


@pytest.mark.parametrize("weight_version", [None, 0, 12])
@pytest.mark.parametrize("choice", COMPLETION_CHOICES)
def test_a_completion_frame_says_what_the_chunk_model_says(
    choice: protocol.CompletionChoice, weight_version: int | None
) -> None:
    def chunk(choices: list[protocol.CompletionChoice]) -> protocol.CompletionChunk:
        return protocol.CompletionChunk(
            id="cmpl-1", created=1700000000, model='m"odel', choices=choices, weight_version=weight_version
        )

    framed = sse_frames.Frame(chunk([])).event(protocol.dump(choice))
    assert parsed(framed) == parsed(sse_frames.event(protocol.dump(chunk([choice]))))


@pytest.mark.parametrize("choice", CHAT_CHOICES)
def test_a_chat_frame_says_what_the_chunk_model_says(choice: protocol.ChatStreamChoice) -> None:
    def chunk(choices: list[protocol.ChatStreamChoice]) -> protocol.ChatCompletionChunk:
        return protocol.ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=choices, weight_version=3)

    framed = sse_frames.Frame(chunk([])).event(protocol.dump(choice))
    assert parsed(framed) == parsed(sse_frames.event(protocol.dump(chunk([choice]))))


def test_ascii_frames_are_byte_for_byte_the_old_events() -> None:
    choice = protocol.CompletionChoice(index=0, text=" hi", token_ids=[4])
    envelope = protocol.CompletionChunk(id="cmpl-2", created=5, model="m", choices=[], weight_version=1)
    full = protocol.CompletionChunk(id="cmpl-2", created=5, model="m", choices=[choice], weight_version=1)
    assert sse_frames.Frame(envelope).event(protocol.dump(choice)) == sse_frames.event(protocol.dump(full))


def test_a_chunk_with_choices_cannot_be_a_frame() -> None:
    with pytest.raises(ValueError, match="no empty choices"):
        sse_frames.Frame(
            protocol.CompletionChunk(
                id="c", created=1, model="m", choices=[protocol.CompletionChoice(index=0, text="")], weight_version=None
            )
        )
