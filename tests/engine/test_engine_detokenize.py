"""Per-choice text: incremental detokenization, multi-byte characters split across tokens, and stop
strings that span tokens (held back, then trimmed). A byte-level stand-in tokenizer keeps these
exact and fast; the served tests cover the real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from megafleet_engine.backends import base
from megafleet_engine.openai import generation


class ByteTokenizer:
    """Token id = byte value; decoding replaces incomplete UTF-8 like Hugging Face's byte-level decoder."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return bytes(token_ids).decode(errors="replace")

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any:
        raise NotImplementedError


def _run(
    text: str, stop: tuple[str, ...] = (), finish_after: int | None = None
) -> tuple[list[str], generation.ChoiceState]:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    spec = generation.SequenceSpec(0, (1,), base.SamplingParams(max_tokens=len(ids)), stop)
    state = generation.ChoiceState(spec)
    deltas = []
    last = len(ids) if finish_after is None else finish_after
    for position, token in enumerate(ids[:last], start=1):
        finish: base.FinishReason | None = "length" if position == last else None
        delta = state.feed(base.TokenStep("r", token, None, (), finish), tokenizer)
        deltas.append(delta.text)
        if state.finished:
            break
    return deltas, state


def test_text_grows_token_by_token_and_joins_to_the_whole() -> None:
    deltas, state = _run("hello")
    assert deltas == ["h", "e", "l", "l", "o"]
    assert state.text == "hello" and state.finish_reason == "length"


def test_split_multibyte_character_is_held_until_complete() -> None:
    deltas, _ = _run("aé")  # é is two bytes
    assert deltas == ["a", "", "é"]
    assert "\ufffd" not in "".join(deltas)


def test_stop_string_across_tokens_is_trimmed_and_never_streamed() -> None:
    deltas, state = _run("say STOP now", stop=("STOP",))
    assert "".join(deltas) == "say "
    assert state.text == "say " and state.finish_reason == "stop"
    assert state.token_ids == list(b"say STOP"), "the tokens that made the stop string are kept"


def test_earliest_of_several_stop_strings_wins() -> None:
    _, state = _run("abcdef", stop=("de", "bc"))
    assert state.text == "a" and state.finish_reason == "stop"


def test_held_back_text_is_flushed_when_the_choice_ends_without_a_stop() -> None:
    deltas, state = _run("xyST", stop=("STOP",))
    assert deltas == ["", "", "", "xyST"], "up to len('STOP') - 1 characters are held back"
    assert state.text == "xyST" and state.finish_reason == "length"


@pytest.mark.parametrize("text", ["STOP", "aSTOP", "STOPSTOP"])
def test_stop_at_any_position(text: str) -> None:
    _, state = _run(text, stop=("STOP",))
    assert state.text == text[: text.index("STOP")]
