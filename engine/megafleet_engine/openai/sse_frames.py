"""Server-sent events of a streamed response: one chunk dumped whole (:func:`event`), and the frame
of a stream's chunks around one choice each (:class:`Frame`, the fast path of every token).

Used by :mod:`megafleet_engine.openai.serving` for completion and chat streams.
"""

from __future__ import annotations

import json

import msgspec

from megafleet_engine.openai import protocol

__all__ = ["Frame", "event"]


def event(data: dict[str, object]) -> bytes:
    """One SSE event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


_encode = msgspec.json.Encoder().encode


class Frame:
    """One stream's SSE event around its choices, made once per stream from the chunk model (with
    no choices), so a token costs one small dict and one fast encode, not a pydantic model built,
    validated and dumped per token (``bench/serving.py``'s streaming path). :meth:`Frame.event` equals
    :func:`event` of the same chunk dumped with that choice (a test compares them).

    Args:
        envelope: the stream's chunk with ``choices=[]``: its id, model, weight version.
    """

    def __init__(self, envelope: protocol.OpenAIBaseModel) -> None:
        text = json.dumps(protocol.dump(envelope), separators=(",", ":"))
        head, marker, tail = text.partition('"choices":[]')
        if not marker:
            raise ValueError(f"{type(envelope).__name__} has no empty choices to frame")
        self._head = f'data: {head}"choices":['.encode()
        self._tail = f"]{tail}\n\n".encode()

    def event(self, choice: dict[str, object]) -> bytes:
        """The event of one chunk with ``choice`` (JSON-ready data, ``None`` fields left out)."""
        return self._head + _encode(choice) + self._tail
