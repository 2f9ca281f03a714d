"""The logic behind ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and its batch extension.

Called by the thin router (:mod:`megafleet_engine.openai.router`), which picks the streaming or the
non-streaming method from ``request.stream``. Serving checks a request against the model
(:mod:`~megafleet_engine.openai.request_checks`) and raises typed errors
(:mod:`megafleet_engine.openai.errors`), never building error responses itself; a request that fails
inside the engine is a 500 naming it (:mod:`~megafleet_engine.openai.failures`); errors that occur
after a stream has started become an SSE error chunk followed by ``data: [DONE]``.

Every response is stamped with the weight version that produced it: the version the engine
reported with the request's first tokens; every choice carries its ``weight_version_spans``
(:mod:`~megafleet_engine.openai.version_spans`: which of its tokens came from which version). A
stream's choice carries its tokens' ``weight_version`` (a chunk never mixes versions:
:meth:`~megafleet_engine.openai.engine_client.Batch.next` splits at a change), and its last chunk
the whole spans.

A request's choices (every prompt of a multi-prompt completion times ``n``) go to the engine as one
batch and come back one engine step at a time (:class:`~megafleet_engine.openai.engine_client.Batch`):
a stream writes one piece per step, and a non-streaming choice without stop strings is decoded
once at its end; with ``detokenize: false`` (token-ids-only, for RL clients) nothing is decoded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import jinja2

from megafleet_engine import engine as engine_module
from megafleet_engine import metrics as metrics_module
from megafleet_engine.backends import base
from megafleet_engine.openai import choices, engine_client, errors, failures, protocol, request_checks, sse_frames

__all__ = ["ChatServing", "CompletionServing", "ModelServing", "ServingContext", "Stream"]

log = logging.getLogger(__name__)

MISSING_LOGPROB = -9999.0
"""What chat log-probabilities show when the backend gave none (OpenAI's own placeholder), and the
floor of every log-probability shown: a token the sampling filter cut (an alternative in
``top_logprobs`` of processed log-probabilities) has ``-inf``, which JSON cannot carry (vLLM shows
it the same way)."""


@dataclasses.dataclass(frozen=True)
class ServingContext:
    """Everything the serving classes share: the engine (through a client), its tokenizer and the
    frontend's metrics."""

    client: engine_client.EngineClient
    tokenizer: base.Tokenizer
    metrics: metrics_module.FrontendMetrics

    @property
    def info(self) -> base.ModelInfo:
        return self.client.info


@dataclasses.dataclass(frozen=True)
class Stream:
    """A started streaming response: the weight version it serves and its SSE events."""

    weight_version: int | None
    events: AsyncIterator[bytes]
    close: Callable[[], object]  # idempotent; the router runs it after the response as a safety net


class ModelServing:
    """``GET /v1/models``: the one model this engine serves."""

    def __init__(self, context: ServingContext) -> None:
        self._context = context
        self._created = int(time.time())

    def list_models(self) -> protocol.ModelList:
        info = self._context.info
        card = protocol.ModelCard(id=info.name, created=self._created, max_model_len=info.max_sequence_length)
        return protocol.ModelList(data=[card], weight_version=self._context.client.weight_version)

    def get_model(self, name: str) -> protocol.ModelCard:
        request_checks.check_model(self._context.info, name)
        return self.list_models().data[0]


# -- the shared request pipeline --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A validated request: its choices, the distinct prompts they continue, and whether the client
    wants text (``False``: ``detokenize: false``, token ids only)."""

    request_id: str
    specs: list[choices.SequenceSpec]
    prompts: list[tuple[int, ...]]
    text: bool = True


Step = list[tuple[int, base.TokenStep]]


class _Pipeline:
    """Prepare, start and drive the choices of one request; shared by completions and chat."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    def prepare(
        self,
        request: protocol.SamplingRequest,
        prompts: Sequence[Sequence[int]],
        *,
        request_id: str,
        param: str,
        each: str | None = None,
    ) -> _Prepared:
        """Validate ``prompts`` (token ids) against the model and build their choices, ``n`` each.

        Errors name ``param``; with ``each`` (a batch of conversations: ``"conversation"``) they name
        the prompt at fault, ``param.<index>``, and their message says ``conversation <index>``."""
        info = self.context.info
        request_checks.check_model(info, request.model)
        request_checks.check_sequences(len(prompts), request.n, noun=each or "prompt")
        request_checks.check_stop_token_ids(request.stop_token_ids or (), info.vocab_size)
        specs: list[choices.SequenceSpec] = []
        for prompt_index, prompt in enumerate(prompts):
            where = param if each is None else f"{param}.{prompt_index}"
            subject = "the prompt" if each is None else f"the prompt of {each} {prompt_index}"
            request_checks.check_token_ids(prompt, info.vocab_size, param=where, subject=subject)
            max_tokens = request_checks.max_tokens(
                len(prompt), request, info.max_sequence_length, param=where, subject=subject
            )
            for sample in range(request.n):
                index = prompt_index * request.n + sample
                params = request.to_sampling_params(max_tokens=max_tokens, choice=index, vocab_size=info.vocab_size)
                specs.append(choices.SequenceSpec(index, tuple(prompt), params, request.stop_strings))
        prompt_tuples = [tuple(prompt) for prompt in prompts]
        return _Prepared(request_id, specs, prompt_tuples, text=request.detokenize)

    async def complete(self, prepared: _Prepared) -> tuple[dict[int, choices.ChoiceState], engine_client.Batch]:
        """Run every choice to its end (a non-streaming response): their states and their batch
        (its weight versions). Text is made incrementally only where a stop string needs it, else once."""
        batch, first = await self.start(prepared)
        states = _states(prepared)
        eager = prepared.text and any(spec.stop for spec in prepared.specs)
        try:
            async for _ in self.steps(batch, first, states, text=eager):
                pass
        finally:
            batch.close()
        if prepared.text and not eager:
            for state in states.values():
                state.settle(self.context.tokenizer)
        return states, batch

    async def start(self, prepared: _Prepared) -> tuple[engine_client.Batch, Step]:
        """Submit every choice as one batch and wait for the first step: errors here are plain HTTP
        errors."""
        started = time.monotonic()
        requests = [
            base.SequenceRequest(f"{prepared.request_id}-{spec.index}", spec.prompt_token_ids, spec.params)
            for spec in prepared.specs
        ]
        try:
            batch = await self.context.client.submit(requests)
        except engine_module.EngineError as error:
            raise failures.engine_error(error) from error
        try:
            first = await self.next(batch)
        except BaseException:
            batch.close()
            raise
        if first is None:
            batch.close()
            raise errors.InternalError("the engine produced no tokens")
        self.context.metrics.observe_first_token(time.monotonic() - started)
        self.context.metrics.count_prompt_tokens(sum(len(prompt) for prompt in prepared.prompts))
        return batch, first

    async def next(self, batch: engine_client.Batch) -> Step | None:
        try:
            return await batch.next()
        except engine_module.EngineError as error:
            raise failures.engine_error(error) from error

    async def steps(
        self,
        batch: engine_client.Batch,
        first: Step,
        states: dict[int, choices.ChoiceState],
        *,
        text: bool,
    ) -> AsyncIterator[tuple[list[choices.Delta], int | None]]:
        """Every engine step's deltas, one list per step, with the weight version of their tokens;
        stop a choice whose stop string matched. ``text``: detokenize as the tokens come (else only
        keep them)."""
        tokenizer = self.context.tokenizer
        tokens: Step | None = first
        while tokens is not None:
            deltas = []
            for index, step in tokens:
                state = states[index]
                deltas.append(state.feed(step, tokenizer) if text else state.append(step))
                if state.finished:
                    batch.stop(index)
            yield deltas, batch.version
            tokens = await self.next(batch)

    async def sse(
        self, prepared: _Prepared, batch: engine_client.Batch, events: AsyncIterator[list[bytes]]
    ) -> AsyncIterator[bytes]:
        """Server-sent events, one write per engine step (``events`` yields each step's); a failure
        mid-stream becomes an error event (logged with the request's id, as :func:`failures` does)."""
        weight_version = batch.weight_version
        try:
            async for step_events in events:
                if step_events:
                    yield b"".join(step_events)
        except Exception as error:
            failed = error if isinstance(error, errors.HTTPError) else None
            if failed is None or failed.status == errors.InternalError.status:
                failed = failures.failed(prepared.request_id, error)
            yield sse_frames.event({**errors.envelope(failed), "weight_version": weight_version})
        finally:
            batch.close()
        yield b"data: [DONE]\n\n"

    def usage(self, prepared: _Prepared, states: dict[int, choices.ChoiceState]) -> protocol.Usage:
        prompt_tokens = sum(len(prompt) for prompt in prepared.prompts)
        completion_tokens = sum(len(state.steps) for state in states.values())
        return protocol.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def token_text(self, token_id: int, *, text: bool = True) -> str:
        """A token as log-probabilities show it: its text, or ``token_id:<id>`` without text
        (``detokenize: false``; vLLM's ``return_tokens_as_token_ids`` form)."""
        return self.context.tokenizer.decode([token_id]) if text else f"token_id:{token_id}"


def _token_prompts(prompt: protocol.Prompt, tokenizer: base.Tokenizer) -> list[list[int]]:
    """A completion's prompts as token ids: text, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    single: list[int] = []
    prompts: list[list[int]] = []
    for item in prompt:
        if isinstance(item, int):
            single.append(item)
        elif isinstance(item, str):
            prompts.append(tokenizer.encode(item))
        else:
            prompts.append(list(item))
    return [single] if single else prompts


def _spans(batch: engine_client.Batch, index: int) -> list[protocol.VersionSpan]:
    """Choice ``index``'s version spans as the API shows them."""
    return [protocol.VersionSpan(start=span.start, version=span.version, kv=span.kv) for span in batch.spans(index)]


def _stamp(choice: dict[str, object], batch: engine_client.Batch, delta: choices.Delta, version: int | None) -> None:
    """Add to a streamed ``choice`` its tokens' weight ``version`` and, on its last chunk, its spans."""
    if version is not None:
        choice["weight_version"] = version
    if delta.finish_reason is not None:
        choice["weight_version_spans"] = [protocol.dump(span) for span in _spans(batch, delta.index)]


def _states(prepared: _Prepared) -> dict[int, choices.ChoiceState]:
    return {spec.index: choices.ChoiceState(spec) for spec in prepared.specs}


# -- completions ------------------------------------------------------------------------------------


class CompletionServing:
    """``POST /v1/completions``: one prompt or many (OpenAI's batch form), each with ``n`` choices."""

    def __init__(self, context: ServingContext) -> None:
        self._pipeline = _Pipeline(context)
        self._context = context

    async def create(self, request: protocol.CompletionRequest) -> protocol.CompletionResponse:
        request_id = failures.new_request_id("cmpl")
        with failures.failures(request_id):
            prepared = self._prepare(request, request_id)
            states, batch = await self._pipeline.complete(prepared)
            response_choices = [
                self._choice(request, state, _spans(batch, state.spec.index)) for state in states.values()
            ]
            return protocol.CompletionResponse(
                id=prepared.request_id,
                created=int(time.time()),
                model=request.model,
                choices=response_choices,
                usage=self._pipeline.usage(prepared, states),
                weight_version=batch.weight_version,
            )

    async def stream(self, request: protocol.CompletionRequest) -> Stream:
        request_id = failures.new_request_id("cmpl")
        with failures.failures(request_id):
            prepared = self._prepare(request, request_id)
            batch, first = await self._pipeline.start(prepared)
        weight_version = batch.weight_version
        chunks = self._chunks(request, prepared, batch, first, weight_version)
        return Stream(weight_version, self._pipeline.sse(prepared, batch, chunks), batch.close)

    def _prepare(self, request: protocol.CompletionRequest, request_id: str) -> _Prepared:
        prompts = _token_prompts(request.prompt, self._context.tokenizer)
        return self._pipeline.prepare(request, prompts, request_id=request_id, param="prompt")

    async def _chunks(
        self,
        request: protocol.CompletionRequest,
        prepared: _Prepared,
        batch: engine_client.Batch,
        first: Step,
        weight_version: int | None,
    ) -> AsyncIterator[list[bytes]]:
        states = _states(prepared)
        started: set[int] = set()
        created = int(time.time())
        wants_steps = request.logprobs is not None or request.wants_token_ids
        ids = request.wants_token_ids
        envelope = protocol.CompletionChunk(
            id=prepared.request_id, created=created, model=request.model, choices=[], weight_version=weight_version
        )
        frame = sse_frames.Frame(envelope)
        async for deltas, version in self._pipeline.steps(batch, first, states, text=prepared.text):
            events: list[bytes] = []
            for delta in deltas:
                if not (delta.text or delta.finish_reason or wants_steps):
                    continue
                choice: dict[str, object] = {"index": delta.index, "text": delta.text}
                _stamp(choice, batch, delta, version)
                if request.logprobs is not None:
                    offset = states[delta.index].text_length - len(delta.text)
                    logprobs = self._logprobs(delta.steps, offset, text=request.detokenize)
                    choice["logprobs"] = protocol.dump(logprobs)
                if delta.finish_reason is not None:
                    choice["finish_reason"] = delta.finish_reason
                if ids:
                    choice["token_ids"] = [step.token_id for step in delta.steps]
                    if delta.index not in started:
                        choice["prompt_token_ids"] = list(states[delta.index].spec.prompt_token_ids)
                started.add(delta.index)
                events.append(frame.event(choice))
            yield events
        if request.include_usage:
            envelope.usage = self._pipeline.usage(prepared, states)
            yield [sse_frames.event(protocol.dump(envelope))]

    def _choice(
        self, request: protocol.CompletionRequest, state: choices.ChoiceState, version_spans: list[protocol.VersionSpan]
    ) -> protocol.CompletionChoice:
        ids = request.wants_token_ids
        steps = state.steps
        return protocol.CompletionChoice(
            index=state.spec.index,
            text=state.text,
            logprobs=self._logprobs(steps, 0, text=request.detokenize) if request.logprobs is not None else None,
            finish_reason=state.finish_reason,
            token_ids=[step.token_id for step in steps] if ids else None,
            prompt_token_ids=list(state.spec.prompt_token_ids) if ids else None,
            weight_version_spans=version_spans,
        )

    def _logprobs(self, steps: Sequence[base.TokenStep], offset: int, *, text: bool) -> protocol.CompletionLogprobs:
        result = protocol.CompletionLogprobs()
        for step in steps:
            token = self._pipeline.token_text(step.token_id, text=text)
            result.tokens.append(token)
            chosen = None if step.logprob is None else _shown(step.logprob)
            result.token_logprobs.append(chosen)
            # keyed by text (OpenAI's shape): tokens that decode alike keep the first, most likely one
            top = {token: chosen} if chosen is not None else {}
            for token_id, logprob in step.top_logprobs:
                top.setdefault(self._pipeline.token_text(token_id, text=text), _shown(logprob))
            result.top_logprobs.append(top)
            if text:
                result.text_offset.append(offset)
                offset += len(token)
        return result


# -- chat completions -------------------------------------------------------------------------------


class ChatServing:
    """``POST /v1/chat/completions``: the messages through the tokenizer's chat template; and
    ``POST /v1/chat/completions/batch`` (extension): several conversations, each rendered on its own,
    all admitted as one batch and answered in one response (choice ``i * n + k`` is conversation
    ``i``'s ``k``-th)."""

    def __init__(self, context: ServingContext) -> None:
        self._pipeline = _Pipeline(context)
        self._context = context

    async def create(self, request: protocol.ChatSamplingRequest) -> protocol.ChatCompletionResponse:
        request_id = failures.new_request_id("chatcmpl")
        with failures.failures(request_id):
            prepared = self._prepare(request, request_id)
            states, batch = await self._pipeline.complete(prepared)
            return self._response(request, prepared, states, batch)

    async def stream(self, request: protocol.ChatSamplingRequest) -> Stream:
        request_id = failures.new_request_id("chatcmpl")
        with failures.failures(request_id):
            prepared = self._prepare(request, request_id)
            batch, first = await self._pipeline.start(prepared)
        weight_version = batch.weight_version
        chunks = self._chunks(request, prepared, batch, first, weight_version)
        return Stream(weight_version, self._pipeline.sse(prepared, batch, chunks), batch.close)

    def _response(
        self,
        request: protocol.ChatSamplingRequest,
        prepared: _Prepared,
        states: dict[int, choices.ChoiceState],
        batch: engine_client.Batch,
    ) -> protocol.ChatCompletionResponse:
        ids = request.wants_token_ids
        response_choices = [
            protocol.ChatChoice(
                index=state.spec.index,
                message=protocol.AssistantMessage(content=state.text),
                logprobs=self._logprobs(state.steps, text=request.detokenize) if request.logprobs else None,
                finish_reason=state.finish_reason,
                token_ids=state.token_ids if ids else None,
                prompt_token_ids=list(state.spec.prompt_token_ids) if ids else None,
                weight_version_spans=_spans(batch, state.spec.index),
            )
            for state in states.values()
        ]
        return protocol.ChatCompletionResponse(
            id=prepared.request_id,
            created=int(time.time()),
            model=request.model,
            choices=response_choices,
            usage=self._pipeline.usage(prepared, states),
            weight_version=batch.weight_version,
        )

    def _prepare(self, request: protocol.ChatSamplingRequest, request_id: str) -> _Prepared:
        request_checks.check_model(self._context.info, request.model)
        conversations = request.conversations()
        batched = isinstance(request, protocol.ChatBatchRequest)
        request_checks.check_sequences(len(conversations), request.n, noun="conversation")
        prompts = [
            self._render(conversation, index if batched else None) for index, conversation in enumerate(conversations)
        ]
        each = "conversation" if batched else None
        return self._pipeline.prepare(request, prompts, request_id=request_id, param="messages", each=each)

    def _render(self, conversation: list[dict[str, str]], index: int | None) -> list[int]:
        """One conversation's prompt: its messages through the chat template, as token ids; errors
        name the conversation's ``index`` in a batch (``None``: the request's only one)."""
        try:
            prompt = self._context.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except (jinja2.TemplateError, ValueError) as error:
            param, label = ("messages", "") if index is None else (f"messages.{index}", f"conversation {index}: ")
            message = f"{label}the chat template rejected the messages: {error}"
            raise errors.InvalidRequest(message, param=param) from None
        if not isinstance(prompt, list) or not all(isinstance(token, int) for token in prompt):
            raise errors.InternalError("the chat template did not produce token ids")
        return prompt

    async def _chunks(
        self,
        request: protocol.ChatSamplingRequest,
        prepared: _Prepared,
        batch: engine_client.Batch,
        first: Step,
        weight_version: int | None,
    ) -> AsyncIterator[list[bytes]]:
        ids = request.wants_token_ids
        envelope = protocol.ChatCompletionChunk(
            id=prepared.request_id,
            created=int(time.time()),
            model=request.model,
            choices=[],
            weight_version=weight_version,
        )
        frame = sse_frames.Frame(envelope)
        opening: list[bytes] = []
        for spec in prepared.specs:  # OpenAI opens every choice with the role
            role: dict[str, object] = {"index": spec.index, "delta": {"role": "assistant", "content": ""}}
            if ids:
                role["prompt_token_ids"] = list(spec.prompt_token_ids)
            opening.append(frame.event(role))
        yield opening
        states = _states(prepared)
        wants_steps = request.logprobs or ids
        async for deltas, version in self._pipeline.steps(batch, first, states, text=prepared.text):
            events: list[bytes] = []
            for delta in deltas:
                if not (delta.text or delta.finish_reason or wants_steps):
                    continue
                choice: dict[str, object] = {"index": delta.index, "delta": {"content": delta.text}}
                _stamp(choice, batch, delta, version)
                if request.logprobs:
                    choice["logprobs"] = protocol.dump(self._logprobs(delta.steps, text=request.detokenize))
                if delta.finish_reason is not None:
                    choice["finish_reason"] = delta.finish_reason
                if ids:
                    choice["token_ids"] = [step.token_id for step in delta.steps]
                events.append(frame.event(choice))
            yield events
        if request.include_usage:
            envelope.usage = self._pipeline.usage(prepared, states)
            yield [sse_frames.event(protocol.dump(envelope))]

    def _logprobs(self, steps: Sequence[base.TokenStep], *, text: bool) -> protocol.ChatLogprobs:
        token_text = self._pipeline.token_text
        content = []
        for step in steps:
            token = token_text(step.token_id, text=text)
            top = [
                protocol.TopLogprob(token=name, logprob=_shown(logprob), bytes=list(name.encode()))
                for name, logprob in ((token_text(token_id, text=text), lp) for token_id, lp in step.top_logprobs)
            ]
            logprob = _shown(step.logprob) if step.logprob is not None else MISSING_LOGPROB
            content.append(
                protocol.TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top)
            )
        return protocol.ChatLogprobs(content=content)


def _shown(logprob: float) -> float:
    """A log-probability as the API shows it: ``-inf`` (a token the sampling filter cut) becomes
    :data:`MISSING_LOGPROB`."""
    return max(logprob, MISSING_LOGPROB)
