"""The messages between the engine core and its API-server processes (MessagePack via msgspec).

API server → core (one PUSH socket per API server, one PULL socket in the core): :class:`Submit`
(the sequences of every request that arrived in one event-loop turn), :class:`Abort` (sequences
whose client went away or whose stop string matched), :class:`Report` (the frontend's metric
observations). Core → API server (one PUSH socket per API server): :class:`Outputs`, once per
engine step with every token of that API server's sequences (as arrays), and :class:`Status` when the engine's
state or weight version changes (and as a heartbeat).

Sequences are named by an integer the API server picks (unique within its ``epoch``, the number of
its start); a restarted API server gets a new epoch, and the core ignores messages of old ones.
"""

from __future__ import annotations

import msgspec

from megafleet_engine.backends import base

__all__ = [
    "Abort",
    "Failure",
    "Outputs",
    "Report",
    "Sequence",
    "Status",
    "Submit",
    "ToApiServer",
    "ToCore",
    "api_decoder",
    "core_decoder",
    "encoder",
    "no_tokens",
]


class Sequence(msgspec.Struct, array_like=True):
    seq: int
    request_id: str
    prompt: list[int]
    params: base.SamplingParams


class Submit(msgspec.Struct, tag="submit", array_like=True):
    epoch: int
    sequences: list[Sequence]


class Abort(msgspec.Struct, tag="abort", array_like=True):
    epoch: int
    seqs: list[int]


class Report(msgspec.Struct, tag="report", array_like=True):
    """Metric observations since the last report: (endpoint, status, seconds) per request, time to
    first token per request, prompt tokens."""

    epoch: int
    requests: list[tuple[str, int, float]]
    first_token: list[float]
    prompt_tokens: int


ToCore = Submit | Abort | Report


class Failure(msgspec.Struct, array_like=True):
    """A sequence the engine ended with an error: ``kind`` names the engine error (``not_serving``,
    ``aborted``, ``error``); ``state`` and ``waited`` are :class:`~megafleet_engine.engine.NotServing`'s."""

    seq: int
    kind: str
    message: str
    state: str | None = None
    waited: float | None = None


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    """One engine step for one API server: every new token and every failure of its sequences.

    The tokens travel as parallel arrays (one entry per token, in step order), not as one struct
    per token: ``seqs`` and ``token_ids`` always; ``logprobs`` (``None`` where a sequence asked for
    none) and ``tops`` (each token's alternatives, ``None`` where it asked for none) only when at
    least one token of the step has them, else ``None``; ``finished``: ``(position, reason)`` for
    the tokens that end their sequence (few per step); ``weight_kv``: how kept sequences entered
    ``weight_version`` (the engine's ``weight_kv``)."""

    weight_version: int | None
    seqs: list[int]
    token_ids: list[int]
    logprobs: list[float | None] | None
    tops: list[list[tuple[int, float]] | None] | None
    finished: list[tuple[int, str]]
    failures: list[Failure]
    weight_kv: str | None = None


def no_tokens(weight_version: int | None, failures: list[Failure]) -> Outputs:
    """An :class:`Outputs` with failures only."""
    return Outputs(weight_version, [], [], None, None, [], failures)


class Status(msgspec.Struct, tag="status", array_like=True):
    state: str
    weight_version: int | None
    accepting: bool


ToApiServer = Outputs | Status

encoder = msgspec.msgpack.Encoder()
core_decoder = msgspec.msgpack.Decoder(ToCore)
api_decoder = msgspec.msgpack.Decoder(ToApiServer)
