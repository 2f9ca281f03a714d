"""A request checked against the served model before anything reaches the engine: its model name,
how many sequences it asks for, its token ids against the vocabulary and its lengths against the
context. Each failure is a typed HTTP error naming the field (a 400, or 404 for the model).

Called by :mod:`megafleet_engine.openai.serving` while it prepares a request; the bounds that need no
model are the request models' own (:mod:`megafleet_engine.openai.protocol`).
"""

from __future__ import annotations

from collections.abc import Sequence

from megafleet_engine.backends import base
from megafleet_engine.openai import errors, protocol

__all__ = [
    "DEFAULT_COMPLETION_TOKENS",
    "check_model",
    "check_sequences",
    "check_stop_token_ids",
    "check_token_ids",
    "max_tokens",
]

DEFAULT_COMPLETION_TOKENS = 16
"""``max_tokens`` of a completion that does not say (OpenAI's default); chat defaults to the rest
of the context."""


def check_model(info: base.ModelInfo, name: str) -> None:
    if name != info.name:
        raise errors.ModelNotFound(
            f"the model `{name}` does not exist; this engine serves `{info.name}`", param="model"
        )


def check_sequences(prompts: int, n: int, *, noun: str) -> None:
    """Refuse a request whose ``prompts`` (of kind ``noun``) times ``n`` exceed the per-request
    bound (a 400 naming ``n``); cheap, so callers run it before any tokenising."""
    if prompts * n > protocol.MAX_N:
        raise errors.InvalidRequest(
            f"{prompts} {noun}s x n={n} is {prompts * n} sequences; one request may ask for at most {protocol.MAX_N}",
            param="n",
        )


def check_stop_token_ids(stop_token_ids: Sequence[int], vocab_size: int) -> None:
    bad = [token for token in stop_token_ids if token >= vocab_size]
    if bad:
        raise errors.InvalidRequest(
            f"stop token id {bad[0]} is outside the vocabulary (0 to {vocab_size - 1})", param="stop_token_ids"
        )


def check_token_ids(prompt: Sequence[int], vocab_size: int, *, param: str, subject: str) -> None:
    if not prompt:
        raise errors.InvalidRequest(f"{subject} is empty", param=param)
    bad = [token for token in prompt if not 0 <= token < vocab_size]
    if bad:
        raise errors.InvalidRequest(
            f"token id {bad[0]} of {subject} is outside the vocabulary (0 to {vocab_size - 1})", param=param
        )


def max_tokens(prompt_length: int, request: protocol.SamplingRequest, limit: int, *, param: str, subject: str) -> int:
    room = limit - prompt_length
    if room < 1:
        raise errors.ContextLengthExceeded(
            f"{subject} is {prompt_length} tokens; the maximum sequence length is {limit}", param=param
        )
    requested = request.requested_max_tokens()
    if requested is None:
        default = DEFAULT_COMPLETION_TOKENS if isinstance(request, protocol.CompletionRequest) else room
        return min(default, room)
    if prompt_length + requested > limit:
        chat_limit = isinstance(request, protocol.ChatSamplingRequest) and request.max_completion_tokens is not None
        name = "max_completion_tokens" if chat_limit else "max_tokens"
        raise errors.ContextLengthExceeded(
            f"{subject} ({prompt_length} tokens) plus {name} ({requested}) exceeds the maximum sequence length {limit}",
            param=name,
        )
    return requested
