"""Per-choice text: incremental detokenization, multi-byte characters split across tokens, and stop
strings that span tokens (held back, then trimmed). A byte-level stand-in tokenizer keeps these
exact and fast; the served tests cover the real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megafleet_engine.backends import base
from megafleet_engine.openai import choices


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
) -> tuple[list[str], choices.ChoiceState]:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    spec = choices.SequenceSpec(0, (1,), base.SamplingParams(max_tokens=len(ids)), stop)
    state = choices.ChoiceState(spec)
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


def _reference(tokenizer: Any, ids: list[int], stop: tuple[str, ...]) -> str:
    """The text of a finished choice by definition: every token decoded at once, cut at the
    earliest stop string."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    found = [position for position in (full.find(s) for s in stop) if position >= 0]
    return str(full[: min(found)] if found else full)


def _feed_all(tokenizer: Any, ids: list[int], stop: tuple[str, ...]) -> tuple[list[str], choices.ChoiceState]:
    spec = choices.SequenceSpec(0, (1,), base.SamplingParams(max_tokens=len(ids)), stop)
    state = choices.ChoiceState(spec)
    deltas = []
    for position, token in enumerate(ids, start=1):
        finish: base.FinishReason | None = "length" if position == len(ids) else None
        deltas.append(state.feed(base.TokenStep("r", token, None, (), finish), tokenizer).text)
        if state.finished:
            break
    return deltas, state


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 255), min_size=1, max_size=60),
    stop=st.lists(st.text(alphabet="ab\u00e9\ufffd", min_size=1, max_size=3), max_size=2).map(tuple),
)
@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_any_bytes_give_the_text_of_decoding_everything_at_once(ids: list[int], stop: tuple[str, ...]) -> None:
    """Invalid and split UTF-8 included: the deltas join to the whole decode (cut at a stop string)."""
    tokenizer = ByteTokenizer()
    deltas, state = _feed_all(tokenizer, ids, stop)
    assert "".join(deltas) == state.text == _reference(tokenizer, ids, stop)
    assert state.text_length == len(state.text)


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Any:
    from megafleet_engine.models import tiny

    return tiny.build_tokenizer()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_the_tiny_models_tokenizer_special_tokens_included(tiny_tokenizer: Any, data: st.DataObject) -> None:
    """The byte-level BPE tokenizer the tiny models serve with (special tokens skipped): windows
    decode to exactly the whole decode."""
    ids = data.draw(st.lists(st.integers(0, len(tiny_tokenizer) - 1), min_size=1, max_size=80))
    text = tiny_tokenizer.decode(ids, skip_special_tokens=True)
    deltas, state = _feed_all(tiny_tokenizer, ids, ())
    assert "".join(deltas) == state.text == text


def test_each_token_decodes_a_window_not_the_whole_completion() -> None:
    """The work per token does not grow with the completion: the tokenizer is asked to decode at
    most a few tokens at a time (it decoded every token so far, at every step, before)."""

    class Counting(ByteTokenizer):
        longest = 0

        def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
            Counting.longest = max(Counting.longest, len(token_ids))
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens)

    text = "long completion with é and € and 😀 " * 40
    deltas, state = _feed_all(Counting(), list(text.encode()), ())
    assert state.text == text and "".join(deltas) == text
    assert Counting.longest <= 8, Counting.longest  # a 4-byte character and the tokens before it
