"""Request and response bodies of the OpenAI-compatible API (pydantic models only).

Read by the router (FastAPI validates requests against these) and written by
:mod:`megafleet_engine.openai.serving`. Requests convert themselves to the backend's
:class:`~megafleet_engine.backends.base.SamplingParams` (:meth:`SamplingRequest.to_sampling_params`).
Imports only pydantic and the backend's plain dataclasses (no torch).

RL extensions beyond OpenAI: ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``,
``detokenize`` (``false``: token ids only), ``logprobs_mode`` (requests); ``token_ids`` and
``prompt_token_ids`` per choice, ``weight_version`` on every response and stream chunk (the version
of the first token), ``weight_version_spans`` per choice (:class:`VersionSpan`: which tokens came
from which version) and ``weight_version`` per streamed choice (its tokens' version); and
:class:`ChatBatchRequest`, several conversations in one request (``/v1/chat/completions/batch``).

Every number a request carries is bounded here, or by serving against the model (token ids against
the vocabulary, lengths against the context): out of range is a 400 naming the field, so nothing
reaches the engine that it cannot take (its core's messages carry at most 64-bit integers,
``docs/incidents.md#number-beyond-64-bits-hang``). ``docs/operations.md`` lists the bounds.
"""

from __future__ import annotations

import abc
import logging
from typing import Annotated, Any, Literal

import pydantic
import pydantic_core
from pydantic import Field

from megafleet_engine.backends import base
from megafleet_protocol import frontend

log = logging.getLogger(__name__)

MAX_N = frontend.MAX_SEQUENCES_PER_REQUEST
"""Most choices one request may ask for, prompts times ``n``: each is a sequence in the batch."""
MAX_LOGPROBS = 20
"""Most alternatives per token (OpenAI's limit for chat ``top_logprobs``)."""
MAX_STOP = 16
"""Most stop strings per request."""
MAX_STOP_CHARACTERS = 1000
"""Longest stop string, in characters: every engine step of a choice searches the text it holds
back for each stop string, so the search must stay cheap."""
MAX_STOP_TOKEN_IDS = 256
"""Most ``stop_token_ids`` per request."""
INT32_MAX = 2**31 - 1
"""Largest ``top_k`` and token id taken: backends keep both in 32-bit tensors, and the engine core's
messages carry at most 64-bit integers (a larger one cannot be sent to the engine at all). Serving
checks token ids against the vocabulary, and any ``top_k`` at or above it means no cut."""
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily: dividing logits by less overflows float32 (NaN samples)."""
SEED_MODULUS = 2**64
"""Seeds are taken modulo this: torch generators take unsigned 64-bit seeds."""
LOGGED_NAMES = 8
"""Most ignored field names one log line lists (the rest are counted)."""
LOGGED_CHARACTERS = 64
"""Longest piece of request text a log line shows (longer ones are cut, marked ``...``)."""
LONE_SURROGATE = "lone_surrogate"
"""Validation error type of text that is not Unicode; its context's ``param`` names the field."""


def printable(text: str, *, limit: int | None = LOGGED_CHARACTERS) -> str:
    """``text`` safe for one log line: control characters, line and paragraph separators and
    lone surrogates escaped as Python writes them (``\\n``, ``\\x1b``, ``\\ud800``), cut to
    ``limit`` characters (``None``: never cut). Every log call that shows request data passes it
    through this, so a client cannot forge or split log lines; the API servers' log formatter
    applies it to every message as well."""
    cut = limit is not None and len(text) > limit
    shown = text[:limit] if cut else text
    if not shown.isprintable():
        shown = "".join(char if char.isprintable() else repr(char)[1:-1] for char in shown)
    return shown + "..." if cut else shown


def find_lone_surrogate(data: object) -> str | None:
    """The dotted path (``messages.0.content``) of the first string in ``data`` (parsed JSON: keys
    included; a bad key names its object, ``body`` at the top) holding a lone UTF-16 surrogate, else
    ``None``. JSON's ``\\ud800`` escape decodes to such a string, which no tokenizer or UTF-8
    encoder takes; paired surrogates decode to one character and pass. Iterative, with each path
    kept as a link to its parent's, so deep nesting costs neither stack nor quadratic memory."""
    pending: list[tuple[object, _Path]] = [(data, None)]
    while pending:
        value, path = pending.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return _dotted(path)
        elif isinstance(value, dict):
            if not all(_is_unicode(key) for key in value if isinstance(key, str)):
                return _dotted(path)
            pending.extend((item, (str(key), path)) for key, item in value.items())
        elif isinstance(value, list):
            pending.extend((item, (str(index), path)) for index, item in enumerate(value))
    return None


_Path = tuple[str, "_Path"] | None
"""A path in parsed JSON as (last key, parent's path); ``None`` is the body itself."""


def _dotted(path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        parts.append(path[0])
        path = path[1]
    return ".".join(reversed(parts)) or "body"


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class OpenAIBaseModel(pydantic.BaseModel):
    """Accepts fields it does not know (clients send many) but logs them, so nothing is ignored silently."""

    model_config = pydantic.ConfigDict(extra="allow", allow_inf_nan=False)

    @pydantic.model_validator(mode="after")
    def _log_ignored(self) -> OpenAIBaseModel:
        if self.model_extra:
            names = sorted(self.model_extra)
            shown = ", ".join(printable(name) for name in names[:LOGGED_NAMES])
            more = f" and {len(names) - LOGGED_NAMES} more" if len(names) > LOGGED_NAMES else ""
            log.info("ignoring unsupported %s fields: %s%s", type(self).__name__, shown, more)
        return self


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields completions and chat completions share."""

    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(
        default=0, ge=-1, le=INT32_MAX, description="0 or -1, or at least the vocabulary: no top-k cut (extension)"
    )
    seed: int | None = Field(default=None, description="any integer; taken modulo 2**64")
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS, description="extension"
    )
    ignore_eos: bool = Field(default=False, description="extension: keep going past the EOS token")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = Field(default=False, description="extension: token ids per choice")
    detokenize: bool = Field(
        default=True,
        description=(
            "extension (vLLM's name), for RL clients: false answers token ids only: every choice's "
            "text is empty, token_ids and prompt_token_ids are returned (as with return_token_ids), "
            "log-probability tokens read token_id:<id>, and no text is made (no stop strings)"
        ),
    )
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        default="processed_logprobs",
        description=(
            "extension (vLLM's names): which distribution log-probabilities (chosen token and "
            "alternatives) come from. processed_logprobs (default): the one tokens are drawn from, "
            "log_softmax of the logits after temperature, top-k and top-p (NeMo RL's trainer "
            "convention; a token the filter cut shows -9999.0); raw_logprobs: log_softmax of the "
            "model's logits (OpenAI's meaning). Greedy requests report raw log-probabilities in both."
        ),
    )
    user: str | None = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        """Refuse text that is not Unicode (a 400 naming the field) before anything reads it: the
        tokenizer, the model-name check and the JSON encoder of any answer would fail on it (a 500)."""
        param = find_lone_surrogate(data)
        if param is not None:
            raise pydantic_core.PydanticCustomError(
                LONE_SURROGATE,
                "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); text must be valid Unicode",
                {"param": param},
            )
        return data

    @pydantic.field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else (stop or [])
        if any(not text for text in strings):
            raise ValueError("stop strings must not be empty")
        if len(strings) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(len(text) > MAX_STOP_CHARACTERS for text in strings):
            raise ValueError(f"stop strings may be at most {MAX_STOP_CHARACTERS} characters long")
        return stop

    @pydantic.field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; leave it 0")
        return value

    @pydantic.field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported; leave it out (ignoring it would change the samples)")
        return bias

    @pydantic.model_validator(mode="after")
    def _stop_needs_text(self) -> SamplingRequest:
        if not self.detokenize and self.stop_strings:
            raise ValueError("stop strings need text: leave detokenize true or use stop_token_ids")
        return self

    @property
    def wants_token_ids(self) -> bool:
        """Whether choices carry ``token_ids`` and ``prompt_token_ids``."""
        return self.return_token_ids or not self.detokenize

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        """The completion length the client asked for, if any."""
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """``None``: no log-probabilities; N: the sampled token's plus N alternatives."""
        return None

    def to_sampling_params(self, *, max_tokens: int, choice: int, vocab_size: int) -> base.SamplingParams:
        """Backend sampling parameters for choice ``choice`` of this request.

        Args:
            max_tokens: the completion length, resolved by serving against the prompt length.
            choice: the choice index; a seeded request gives choice ``i`` seed ``seed + i`` so its
                ``n`` samples differ yet are reproducible.
            vocab_size: the model's; a ``top_k`` at or above it keeps every token, so it becomes 0
                (no cut), the value every backend reads as such.
        """
        return base.SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if self.temperature < GREEDY_BELOW else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if 0 < self.top_k < vocab_size else 0,
            seed=None if self.seed is None else (self.seed + choice) % SEED_MODULUS,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            logprobs_mode="raw" if self.logprobs_mode == "raw_logprobs" else "processed",
        )


# -- completions -----------------------------------------------------------------------------------

Prompt = str | list[int] | list[str | list[int]]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a prompt as text or token ids, or a list of them."""

    prompt: Prompt
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @pydantic.field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and any(isinstance(item, list) and not item for item in prompt):
            raise ValueError("token-id prompts must not be empty")
        if isinstance(prompt, list) and any(isinstance(item, int) and item < 0 for item in prompt):
            raise ValueError("token ids must not be negative")
        return prompt

    @pydantic.field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @pydantic.field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class VersionSpan(OpenAIBaseModel):
    """Extension: the choice's generated tokens from ``start`` (counted from 0) up to the next
    span's start came from weight ``version`` (left out when the engine had none); on a span after
    the first, ``kv`` says how the KV of the earlier tokens crossed that switch (``persist``,
    ``recompute``, ``offload``)."""

    start: int
    version: int | None = None
    kv: str | None = None


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    weight_version: int | None = None  # extension, streams only: the version of this chunk's tokens
    weight_version_spans: list[VersionSpan] | None = None  # extension; streams: on the last chunk


class Usage(OpenAIBaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    weight_version: int | None


# -- chat completions ------------------------------------------------------------------------------


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


Conversation = Annotated[list[ChatMessage], Field(min_length=1)]
"""One conversation of a batch: at least one message."""


class ChatSamplingRequest(SamplingRequest):
    """Fields both chat endpoints share; each says which conversations it carries."""

    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @pydantic.model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatSamplingRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @abc.abstractmethod
    def conversations(self) -> list[list[dict[str, str]]]:
        """Every conversation, in order, each as the chat template expects its messages."""


class ChatCompletionRequest(ChatSamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)

    def conversations(self) -> list[list[dict[str, str]]]:
        return [_conversation(self.messages)]


class ChatBatchRequest(ChatSamplingRequest):
    """``POST /v1/chat/completions/batch`` (extension; vLLM's path and shape): ``messages`` is a list of
    conversations, each rendered with the chat template on its own and all admitted as one batch,
    with one sampling for all. Choice ``i * n + k`` is conversation ``i``'s ``k``-th (as a
    multi-prompt completion's). At most :data:`MAX_N` conversations (times ``n``)."""

    messages: list[Conversation] = Field(min_length=1, max_length=MAX_N)

    def conversations(self) -> list[list[dict[str, str]]]:
        return [_conversation(conversation) for conversation in self.messages]


def _conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": message.role, "content": message.text} for message in messages]


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(OpenAIBaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    weight_version_spans: list[VersionSpan] | None = None  # extension


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    weight_version: int | None


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    weight_version: int | None = None  # extension: the version of this chunk's tokens
    weight_version_spans: list[VersionSpan] | None = None  # extension: on the chunk with finish_reason


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    weight_version: int | None


class CompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    weight_version: int | None


# -- models -----------------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "megafleet"
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
    weight_version: int | None


def dump(model: pydantic.BaseModel) -> dict[str, Any]:
    """A response body as JSON-ready data; ``None`` fields are left out (clients read them as null)."""
    return model.model_dump(mode="json", exclude_none=True)
