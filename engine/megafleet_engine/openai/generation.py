"""Running the choices of one OpenAI request on the engine, and turning their tokens into text.

Called by :mod:`megafleet_engine.openai.serving` for completions and chat completions alike: a
:class:`Run` submits every choice to the :class:`~megafleet_engine.engine.Engine` at once (so they
are batched together), merges their token streams, and stops one choice early (stop string) or
all of them (client disconnect, error). A :class:`ChoiceState` per choice holds its tokens,
log-probabilities and the text produced so far, detokenizing incrementally and holding back text
that may still turn out to be the start of a stop string.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base

__all__ = ["ChoiceState", "Delta", "Run", "SequenceSpec"]


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


_END = object()


class Run:
    """The choices of one request, in flight on the engine together.

    :meth:`start` submits the choices; :meth:`close` (always called: after the last token, on an
    error, or when a client disconnect cancels the caller) cancels every choice still running,
    which closes its engine stream so the engine stops generating it at the next step.
    """

    def __init__(self, engine: engine_module.Engine, specs: Sequence[SequenceSpec], *, request_id: str) -> None:
        self._engine = engine
        self._specs = specs
        self._request_id = request_id
        self._events: asyncio.Queue[tuple[int, base.TokenStep | BaseException | object]] = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._open: set[int] = set()

    def start(self) -> None:
        """Submit every choice at once, so the engine batches them together."""
        for spec in self._specs:
            request = base.SequenceRequest(f"{self._request_id}-{spec.index}", spec.prompt_token_ids, spec.params)
            self._tasks[spec.index] = asyncio.create_task(self._pump(spec.index, request))
            self._open.add(spec.index)

    async def next(self) -> tuple[int, base.TokenStep] | None:
        """The next token of any open choice; ``None`` once every choice has finished or stopped.

        Raises what the engine raised for a choice (:class:`~megafleet_engine.engine.NotServing`,
        :class:`~megafleet_engine.engine.Aborted`, ...).
        """
        while self._open:
            index, item = await self._events.get()
            if index not in self._open:
                continue  # a choice stopped early; drop what it had in flight
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                self._open.discard(index)
                continue
            assert isinstance(item, base.TokenStep)
            if item.finish_reason is not None:
                self._open.discard(index)
            return index, item
        return None

    def stop(self, index: int) -> None:
        """Stop one choice early (its stop string matched); the others go on."""
        self._open.discard(index)
        self._tasks[index].cancel()

    async def close(self) -> None:
        """Cancel every choice still running and wait until their engine streams are closed."""
        self._open.clear()
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks.values())

    async def _pump(self, index: int, request: base.SequenceRequest) -> None:
        try:
            async for step in self._engine.submit(request):
                self._events.put_nowait((index, step))
        except Exception as error:  # handed to the consumer, which raises it
            self._events.put_nowait((index, error))
        else:
            self._events.put_nowait((index, _END))
