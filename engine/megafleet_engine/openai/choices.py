"""The choices of one OpenAI request, and turning their tokens into text.

Called by :mod:`megafleet_engine.openai.serving` for completions and chat completions alike (the
engine runs a request's choices as one batch: :mod:`megafleet_engine.openai.engine_client`). A
:class:`ChoiceState` per choice holds its tokens, log-probabilities and the text produced so far:
:meth:`ChoiceState.feed` detokenizes incrementally, holding back text that may still turn out to be
the start of a stop string (streams and stop strings need the text as it grows);
:meth:`ChoiceState.append` only keeps the token, and :meth:`ChoiceState.settle` decodes the whole
completion once at its end (a non-streaming choice without stop strings), or never (token-ids-only
responses).
"""

from __future__ import annotations

import dataclasses

from megafleet_engine.backends import base

__all__ = ["ChoiceState", "Delta", "SequenceSpec"]


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    """One choice to generate: its index in the response, prompt, sampling and stop strings."""

    index: int
    prompt_token_ids: tuple[int, ...]
    params: base.SamplingParams
    stop: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one choice produced since the previous delta (streamed as one chunk entry)."""

    index: int
    text: str
    steps: tuple[base.TokenStep, ...]
    finish_reason: str | None


@dataclasses.dataclass
class ChoiceState:
    """Per-choice state: tokens so far, text emitted so far, whether (and why) it finished.

    Detokenizes incrementally in constant work per token: each step decodes only a window of the
    last tokens, twice (the tokens already turned into text, and the same plus the new ones), and
    takes the difference, as vLLM's detokenizer does; decoding both from the same first token
    cancels whatever a tokenizer does at the start of a text (a SentencePiece word loses its
    leading space there). The window moves on once its text ends with a whole character, so a
    multi-byte character split across tokens appears once complete. Emitted text only grows, and
    while not finished it keeps back the last ``len(longest stop) - 1`` characters, which a stop
    string could start in. A stop string ends the choice with ``finish_reason == "stop"``; its text
    ends before the stop string, while ``token_ids`` keep every token generated (the trainer needs
    them all). Re-decoding every token at every step, as this did before, cost time quadratic in
    the length of a completion, on the event loop (``bench/detokenize.py``).
    """

    spec: SequenceSpec
    steps: list[base.TokenStep] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    text_length: int = 0
    """Characters emitted so far (``len(text)``, without joining the pieces)."""
    _pending: list[base.TokenStep] = dataclasses.field(default_factory=list)
    _ids: list[int] = dataclasses.field(default_factory=list)
    _pieces: list[str] = dataclasses.field(default_factory=list)  # the emitted text, delta by delta
    _held: str = ""  # decoded, not emitted: a stop string may start in it
    _start: int = 0  # the window: ids[_start:_read] are decoded already (their text is emitted or held)
    _read: int = 0

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, step: base.TokenStep, tokenizer: base.Tokenizer) -> Delta:
        """Add one generated token; returns the text it completes (possibly empty)."""
        self.steps.append(step)
        self._pending.append(step)
        self._ids.append(step.token_id)
        ended = step.finish_reason is not None
        settled, unsettled = self._detokenize(tokenizer, flush=ended)
        self._held += settled
        # the unfinished character at the end (a replacement character for now) is not text yet
        candidate = self._held + unsettled.rstrip("\ufffd")
        stop_at = self._find_stop(candidate)
        if stop_at is not None:
            return self._finish(candidate[:stop_at], "stop")
        if step.finish_reason is not None:
            return self._finish(candidate, step.finish_reason)
        hold = max((len(stop) for stop in self.spec.stop), default=1) - 1
        return self._emit(min(len(self._held), max(0, len(candidate) - hold)), None)

    def append(self, step: base.TokenStep) -> Delta:
        """Add one generated token without making text (:meth:`settle` makes it once, at the end)."""
        self.steps.append(step)
        self._ids.append(step.token_id)
        if step.finish_reason is not None:
            self.finish_reason = step.finish_reason
        return Delta(self.spec.index, "", (step,), step.finish_reason)

    def settle(self, tokenizer: base.Tokenizer) -> None:
        """The whole text of a choice fed by :meth:`append`, decoded once."""
        text = tokenizer.decode(self._ids, skip_special_tokens=True)
        self._pieces = [text] if text else []
        self.text_length = len(text)

    def _detokenize(self, tokenizer: base.Tokenizer, *, flush: bool) -> tuple[str, str]:
        """The text the new token adds: settled (final), and unsettled (the window's text while it
        ends inside a character: decoded again at the next token, or taken as it is at the end)."""
        before = tokenizer.decode(self._ids[self._start : self._read], skip_special_tokens=True)
        window = tokenizer.decode(self._ids[self._start :], skip_special_tokens=True)
        added = window[len(before) :]
        if flush or (added and not added.endswith("\ufffd")):
            self._start, self._read = self._read, len(self._ids)
            return added, ""
        return "", added

    def _find_stop(self, candidate: str) -> int | None:
        positions = [candidate.find(stop) for stop in self.spec.stop]
        found = [position for position in positions if position >= 0]
        return min(found) if found else None

    def _finish(self, final_text: str, reason: str) -> Delta:
        self.finish_reason = reason
        self._held = final_text
        return self._emit(len(final_text), reason)

    def _emit(self, count: int, reason: str | None) -> Delta:
        delta, self._held = self._held[:count], self._held[count:]
        if delta:
            self._pieces.append(delta)
            self.text_length += len(delta)
        steps, self._pending = tuple(self._pending), []
        return Delta(self.spec.index, delta, steps, reason)
