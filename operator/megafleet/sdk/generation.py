"""Generate through a fleet's frontends: completions and chat, one prompt or a batch spread over all.

Used by :class:`megafleet.sdk.fleet.Fleet` and :mod:`megafleet.sdk.nemo`, or on its own with frontends
from anywhere (the ``<fleet>-endpoints`` ConfigMap, a test)::

    router = routing.Router([routing.Frontend(0, "http://10.96.0.12:8000/v1", 0), ...])
    async with Generator(router, model="tiny") as generator:
        answers = await generator.complete_batch([[1, 40, 41], "Hello"], Sampling(max_tokens=16, temperature=0))
        answers[0].token_ids, answers[0].logprobs, answers[0].weight_version

Every prompt goes to the shard :meth:`~megafleet.sdk.routing.Router.place` chooses
(:mod:`megafleet.sdk.affinity`): the samples of one prompt (identical prompts of a batch) and the turns
of one conversation reach one engine, which prefills their shared prefix once, while distinct prompts
spread over the shards within a load bound. A completion batch is sent as few batched requests
(``prompt`` as a list: OpenAI's batch form, which the engine admits as one batch): per shard, chunks of
at most :data:`~megafleet_protocol.frontend.MAX_SEQUENCES_PER_REQUEST` prompts (:func:`chunks`), all in
flight at once; a request whose shard fails goes to the frontend with the fewest outstanding
requests. A chat batch goes the same way to the engine's ``/v1/chat/completions/batch`` extension
(``messages`` as a list of conversations, each rendered with the chat template by the
engine: the client needs no tokenizer); OpenAI's chat API has no batch form.
``Sampling(text=False)`` asks for token ids only (the engine's ``detokenize: false``: no text is
made). The engine's RL extensions are always asked for:
``return_token_ids`` (the completion's token ids) and the weight version (``weight_version`` in the
body, ``X-Megafleet-Weight-Version`` header), so every :class:`Answer` says which weights made it;
its ``weight_version_spans`` (:class:`VersionSpan`, the engine's per choice) say which of its tokens
came from which version.
A frontend that answers 503 (suspended for a refit, loading, fenced as stale), 5xx or cannot be reached
is skipped and the request goes to the next one; a 4xx is the request's own fault and is raised at once.
Plain httpx underneath: the OpenAI wire format without the ``openai`` package.

Length limits as vLLM applies them: a token-id prompt's ``max_tokens`` is clamped to the room the
model's length limit leaves (``maxSequenceLength - len(prompt)``), so asking for more than fits is not
an error: generation stops at the limit with finish reason ``length``. A prompt that leaves no room
raises :class:`~megafleet.sdk.errors.PromptTooLong` before anything is sent. The limit is
:attr:`Generator.max_sequence_length` (the fleet client sets it from the fleet's spec), else the
frontend's ``GET /v1/models`` ``max_model_len``, read once. Text and chat prompts are not clamped (their
token count is the engine's): for them the frontend's 400 for ``prompt + max_tokens > limit`` stays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx

from megafleet.sdk import affinity, errors, routing
from megafleet_protocol import frontend as frontend_limits

__all__ = ["DEFAULT_SAMPLING", "WEIGHT_VERSION_HEADER", "Answer", "Generator", "Sampling", "VersionSpan", "chunks"]

WEIGHT_VERSION_HEADER = "X-Megafleet-Weight-Version"
"""Response header the engine stamps with the weight version (``none`` before any weights)."""
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
"""One request may generate for long (10 min); connecting must be quick, so a dead frontend is skipped."""
DEFAULT_LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
"""Enough connections for a large batch in flight at once over many frontends."""

T = TypeVar("T")
Prompt = str | Sequence[int]
Message = Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling parameters of a request (OpenAI's, plus the engine's ``top_k``, ``stop_token_ids``,
    ``ignore_eos``). ``temperature=0`` is greedy. ``logprobs``: return each generated token's log-probability.
    ``text=False``: token ids only (answers' ``text`` is empty; no stop strings), for RL rollouts that
    never read the text."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = True
    text: bool = True

    def body(self) -> dict[str, Any]:
        """The request fields both endpoints share."""
        body: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "return_token_ids": True,
        }
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            body["ignore_eos"] = True
        if not self.text:
            body["detokenize"] = False
        return body


DEFAULT_SAMPLING = Sampling()
"""The engine's defaults: sample at temperature 1 up to the model's length limit, with logprobs."""


@dataclasses.dataclass(frozen=True)
class VersionSpan:
    """From generated token ``start`` on (counted from 0, up to the next span's start), an answer's
    tokens came from weight ``version`` (``None``: the engine had none)."""

    start: int
    version: int | None


@dataclasses.dataclass(frozen=True)
class Answer:
    """One generated choice and where it came from."""

    text: str
    token_ids: list[int]  # generated tokens only
    logprobs: list[float] | None  # one per generated token, when asked for
    prompt_token_ids: list[int] | None
    finish_reason: str | None  # "stop" or "length"
    weight_version: int | None  # the weights that generated its first tokens, as the engine stamped it
    url: str  # the frontend that answered
    shard: int
    weight_version_spans: tuple[VersionSpan, ...] = ()
    """Which generated tokens came from which version, in order; empty from an engine that does not say."""

    @property
    def last_weight_version(self) -> int | None:
        """The version of the last generated token (``weight_version`` when the engine gave no spans)."""
        return self.weight_version_spans[-1].version if self.weight_version_spans else self.weight_version

    @property
    def token_weight_versions(self) -> list[int | None]:
        """The version of each generated token, aligned with ``token_ids`` (all ``weight_version``
        when the engine gave no spans)."""
        spans = self.weight_version_spans or (VersionSpan(0, self.weight_version),)
        count = len(self.token_ids)
        ends = [span.start for span in spans[1:]] + [count]
        versions: list[int | None] = []
        for span, end in zip(spans, ends, strict=True):
            versions.extend([span.version] * max(0, min(end, count) - len(versions)))
        return versions


def chunks(count: int, frontends: int, *, limit: int = frontend_limits.MAX_SEQUENCES_PER_REQUEST) -> list[range]:
    """Split ``count`` prompts into consecutive, near-equal chunks: at least one per frontend (so a
    batch spreads over all of them), each at most ``limit`` prompts (the engine's per-request bound)."""
    if count == 0:
        return []
    pieces = min(count, max(frontends, 1, -(-count // limit)))
    size, extra = divmod(count, pieces)
    bounds = [0]
    for piece in range(pieces):
        bounds.append(bounds[-1] + size + (1 if piece < extra else 0))
    return [range(start, end) for start, end in itertools.pairwise(bounds)]


class Generator:
    """Async OpenAI-compatible client over the frontends of a :class:`~megafleet.sdk.routing.Router`.

    Args:
        router: chooses the frontend of every request; its owner keeps it up to date.
        model: the served model name (the fleet's ``spec.model.servedName``, else its name).
        api_key: sent as ``Authorization: Bearer`` when the fleet's frontends require a key.
        http: an ``httpx.AsyncClient`` to use (closed by its owner); default: one made here.
        max_sequence_length: the model's length limit (prompt plus completion); default: read from
            a frontend's ``/v1/models`` when first needed.
    """

    def __init__(
        self,
        router: routing.Router,
        *,
        model: str,
        api_key: str | None = None,
        http: httpx.AsyncClient | None = None,
        max_sequence_length: int | None = None,
    ) -> None:
        self.router = router
        self.model = model
        self.max_sequence_length = max_sequence_length
        self._limit_read: asyncio.Task[int | None] | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=DEFAULT_TIMEOUT, limits=DEFAULT_LIMITS)
        self._headers = headers

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> Generator:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- requests --------------------------------------------------------------------------------

    async def complete(self, prompt: Prompt, sampling: Sampling = DEFAULT_SAMPLING) -> Answer:
        """``POST /v1/completions`` for one prompt (text or token ids); a token prompt's ``max_tokens``
        is clamped to the length limit's room (see the module docstring)."""
        sampling = await self._fitted(prompt, sampling)
        body = {**sampling.body(), "model": self.model, "prompt": prompt if isinstance(prompt, str) else list(prompt)}
        if sampling.logprobs:
            body["logprobs"] = 0
        return await self._send("/completions", body, _completion_answer, self._place([prompt])[0])

    async def _fitted(self, prompt: Prompt, sampling: Sampling) -> Sampling:
        """``sampling`` clamped for a token prompt (text prompts are not: their length is the engine's)."""
        if isinstance(prompt, str) or sampling.max_tokens is None:
            return sampling
        return await self.fit(len(prompt), sampling)

    async def sequence_limit(self) -> int | None:
        """The model's length limit: :attr:`max_sequence_length`, else the first frontend's
        ``/v1/models`` entry for :attr:`model` (read once; ``None`` when no frontend reports one)."""
        if self.max_sequence_length is not None:
            return self.max_sequence_length
        if self._limit_read is None or (self._limit_read.done() and self._limit_read.result() is None):
            self._limit_read = asyncio.ensure_future(self._read_limit())
        return await asyncio.shield(self._limit_read)

    async def fit(self, prompt_length: int, sampling: Sampling) -> Sampling:
        """``sampling`` with ``max_tokens`` at most the room left after a prompt of ``prompt_length``.

        Raises:
            PromptTooLong: the prompt leaves no room under the limit.
        """
        limit = await self.sequence_limit()
        if limit is None or sampling.max_tokens is None:
            return sampling
        room = limit - prompt_length
        if room < 1:
            raise errors.PromptTooLong(prompt_length, limit)
        return sampling if sampling.max_tokens <= room else dataclasses.replace(sampling, max_tokens=room)

    async def _read_limit(self) -> int | None:
        for frontend in self.router.frontends:
            try:
                response = await self._http.get(f"{frontend.url}/models", headers=self._headers)
            except httpx.TransportError:
                continue
            if response.status_code != 200:
                continue
            for card in response.json().get("data") or []:
                if card.get("id") == self.model and card.get("max_model_len") is not None:
                    self.max_sequence_length = int(card["max_model_len"])
                    return self.max_sequence_length
        return None

    async def chat(self, messages: Sequence[Message], sampling: Sampling = DEFAULT_SAMPLING) -> Answer:
        """``POST /v1/chat/completions`` for one conversation."""
        body = {**sampling.body(), "model": self.model, "messages": [dict(message) for message in messages]}
        if sampling.logprobs:
            body["logprobs"] = True
        return await self._send("/chat/completions", body, _chat_answer, self._place([messages])[0])

    async def complete_batch(self, prompts: Sequence[Prompt], sampling: Sampling = DEFAULT_SAMPLING) -> list[Answer]:
        """Every prompt at once as batched requests (:meth:`batch_requests`), spread over the
        frontends; answers in prompt order. Token prompts whose ``max_tokens`` must be clamped
        differently go in different requests (one request has one ``max_tokens``)."""
        return await self.complete_fitted(prompts, [await self._fitted(prompt, sampling) for prompt in prompts])

    async def complete_fitted(self, prompts: Sequence[Prompt], samplings: Sequence[Sampling]) -> list[Answer]:
        """Every prompt with its own already fitted sampling, as :meth:`batch_requests` all in flight
        at once; answers in prompt order."""
        return await _gathered(len(prompts), self.batch_requests(prompts, samplings))

    def batch_requests(
        self, prompts: Sequence[Prompt], samplings: Sequence[Sampling]
    ) -> list[tuple[list[int], Coroutine[Any, Any, list[Answer]]]]:
        """The batched completion requests for ``prompts``, each with its own (already fitted:
        :meth:`fit`) sampling: prompts of equal sampling share requests, split by :func:`chunks` (one
        per frontend at least); each entry is (the prompt indexes it carries, in order; the request,
        not yet awaited, which returns one answer per index). Callers that stream (the NeMo adapter's
        ``generate_async``) await each request on its own; :meth:`complete_batch` gathers them."""

        def request(sampling: Sampling, shard: int | None, members: list[int]) -> Coroutine[Any, Any, list[Answer]]:
            body = {**sampling.body(), "model": self.model, "prompt": [_wire(prompts[index]) for index in members]}
            if sampling.logprobs:
                body["logprobs"] = 0
            return self._send("/completions", body, _completion_answers, shard, len(members))

        return self._grouped(samplings, self._place(prompts), request)

    async def chat_batch(
        self, conversations: Sequence[Sequence[Message]], sampling: Sampling = DEFAULT_SAMPLING
    ) -> list[Answer]:
        """Every conversation at once as batched requests to the engine's
        ``/v1/chat/completions/batch`` (one per frontend at least, each of at most
        :data:`~megafleet_protocol.frontend.MAX_SEQUENCES_PER_REQUEST` conversations, all in flight
        at once); answers in conversation order."""
        return await _gathered(
            len(conversations), self.chat_batch_requests(conversations, [sampling] * len(conversations))
        )

    def chat_batch_requests(
        self, conversations: Sequence[Sequence[Message]], samplings: Sequence[Sampling]
    ) -> list[tuple[list[int], Coroutine[Any, Any, list[Answer]]]]:
        """The batched chat requests for ``conversations``, each with its own sampling, shaped as
        :meth:`batch_requests`' (conversations of equal sampling share requests)."""

        def request(sampling: Sampling, shard: int | None, members: list[int]) -> Coroutine[Any, Any, list[Answer]]:
            messages = [[dict(message) for message in conversations[index]] for index in members]
            body = {**sampling.body(), "model": self.model, "messages": messages}
            if sampling.logprobs:
                body["logprobs"] = True
            return self._send("/chat/completions/batch", body, _chat_answers, shard, len(members))

        return self._grouped(samplings, self._place(conversations), request)

    def _place(self, prompts: Sequence[Prompt] | Sequence[Sequence[Message]]) -> list[int | None]:
        """The shard of every prompt or conversation (:meth:`~megafleet.sdk.routing.Router.place`)."""
        return self.router.place([affinity.key(prompt) for prompt in prompts])

    def _grouped(
        self,
        samplings: Sequence[Sampling],
        shards: Sequence[int | None],
        request: Callable[[Sampling, int | None, list[int]], Coroutine[Any, Any, list[Answer]]],
    ) -> list[tuple[list[int], Coroutine[Any, Any, list[Answer]]]]:
        """``request(sampling, shard, members)`` for every chunk (:func:`chunks`) of the indexes that
        share a sampling and a shard (``shards``, one per index); with the indexes each carries, in order."""
        groups: dict[tuple[Sampling, int | None], list[int]] = {}
        for index, chosen in enumerate(samplings):
            groups.setdefault((chosen, shards[index]), []).append(index)
        requests: list[tuple[list[int], Coroutine[Any, Any, list[Answer]]]] = []
        for (chosen, shard), indexes in groups.items():
            for piece in chunks(len(indexes), 1):
                members = [indexes[position] for position in piece]
                requests.append((members, request(chosen, shard, members)))
        return requests

    async def _send(
        self,
        path: str,
        body: dict[str, Any],
        parse: Callable[[httpx.Response, routing.Frontend], T],
        shard: int | None = None,
        sequences: int = 1,
    ) -> T:
        """POST ``body`` to shard ``shard``'s frontend (else, or once it failed, the least busy one)."""
        failures: dict[str, str] = {}
        while True:
            try:
                frontend = self.router.acquire(exclude=failures, prefer=shard, sequences=sequences)
            except errors.NoFrontend:
                if failures:
                    raise errors.GenerationFailed(failures) from None
                raise
            try:
                response = await self._http.post(f"{frontend.url}{path}", json=body, headers=self._headers)
            except httpx.TransportError as error:
                failures[frontend.url] = f"{type(error).__name__}: {error}"
                continue
            finally:
                self.router.release(frontend, sequences=sequences)
            if response.status_code == 200:
                return parse(response, frontend)
            failures[frontend.url] = f"HTTP {response.status_code}: {_error_message(response)}"
            if response.status_code < 500:
                raise errors.GenerationFailed(failures)  # the request itself is wrong: same answer anywhere


async def _gathered(count: int, requests: list[tuple[list[int], Coroutine[Any, Any, list[Answer]]]]) -> list[Answer]:
    """Await every request at once; the ``count`` answers in index order."""
    answers: dict[int, Answer] = {}
    for (members, _), got in zip(requests, await asyncio.gather(*(work for _, work in requests)), strict=True):
        answers.update(zip(members, got, strict=True))
    return [answers[index] for index in range(count)]


def _wire(prompt: Prompt) -> str | list[int]:
    return prompt if isinstance(prompt, str) else list(prompt)


def _weight_version(response: httpx.Response, body: Mapping[str, Any]) -> int | None:
    version = body.get("weight_version")
    if version is not None:
        return int(version)
    header = response.headers.get(WEIGHT_VERSION_HEADER)
    return int(header) if header and header != "none" else None


def _completion_answer(response: httpx.Response, frontend: routing.Frontend) -> Answer:
    return _completion_answers(response, frontend)[0]


def _completion_answers(response: httpx.Response, frontend: routing.Frontend) -> list[Answer]:
    """Every choice of a completion, in choice order (a batched request: one per prompt)."""
    return _choices(response, frontend, _completion_choice)


def _choices(
    response: httpx.Response,
    frontend: routing.Frontend,
    parse: Callable[[Mapping[str, Any], httpx.Response, Mapping[str, Any], routing.Frontend], Answer],
) -> list[Answer]:
    """``parse`` applied to every choice of ``response``'s body, in choice-index order."""
    body = response.json()
    return [
        parse(choice, response, body, frontend)
        for choice in sorted(body["choices"], key=lambda choice: int(choice.get("index", 0)))
    ]


def _completion_choice(
    choice: Mapping[str, Any], response: httpx.Response, body: Mapping[str, Any], frontend: routing.Frontend
) -> Answer:
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    return Answer(
        text=choice.get("text", ""),
        token_ids=[int(token) for token in choice.get("token_ids") or []],
        logprobs=None if logprobs is None else [float(value) for value in logprobs],
        prompt_token_ids=choice.get("prompt_token_ids"),
        finish_reason=choice.get("finish_reason"),
        weight_version=_weight_version(response, body),
        url=frontend.url,
        shard=frontend.shard,
        weight_version_spans=_spans(choice),
    )


def _chat_answer(response: httpx.Response, frontend: routing.Frontend) -> Answer:
    return _chat_answers(response, frontend)[0]


def _chat_answers(response: httpx.Response, frontend: routing.Frontend) -> list[Answer]:
    """Every choice of a chat completion, in choice order (a batch: one per conversation)."""
    return _choices(response, frontend, _chat_choice)


def _chat_choice(
    choice: Mapping[str, Any], response: httpx.Response, body: Mapping[str, Any], frontend: routing.Frontend
) -> Answer:
    content = (choice.get("logprobs") or {}).get("content")
    return Answer(
        text=(choice.get("message") or {}).get("content") or "",
        token_ids=[int(token) for token in choice.get("token_ids") or []],
        logprobs=None if content is None else [float(entry["logprob"]) for entry in content],
        prompt_token_ids=choice.get("prompt_token_ids"),
        finish_reason=choice.get("finish_reason"),
        weight_version=_weight_version(response, body),
        url=frontend.url,
        shard=frontend.shard,
        weight_version_spans=_spans(choice),
    )


def _spans(choice: Mapping[str, Any]) -> tuple[VersionSpan, ...]:
    """A choice's ``weight_version_spans`` (empty when the engine gave none)."""
    return tuple(
        VersionSpan(int(span["start"]), None if span.get("version") is None else int(span["version"]))
        for span in choice.get("weight_version_spans") or ()
    )


def _error_message(response: httpx.Response) -> str:
    """The OpenAI error envelope's message, else the start of the body."""
    try:
        error = response.json().get("error") or {}
        return f"{error.get('code') or error.get('type')}: {error.get('message')}"
    except ValueError:
        return response.text[:200]
