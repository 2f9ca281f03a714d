"""Which weight version produced which generated tokens of a sequence: its version spans.

Kept per sequence by :class:`~megafleet_engine.openai.engine_client.Batch` as its tokens arrive,
one engine step at a time, each step stamped with the weight version that computed it; shown on
every choice of a response (``weight_version_spans``) by :mod:`megafleet_engine.openai.serving`.
A span is ``(start, version)``: ``start`` counts the sequence's generated tokens from 0, and token
``i`` was sampled from logits computed with the version of the span with the largest start ``<= i``.
A sequence whose version never changed has one span starting at 0; the spans change only where a
step's version differs from the one before it. A later span also says what happened, at that switch,
to the KV the earlier tokens had computed (``kv``: ``persist``, ``recompute`` or ``offload``; the
engine's ``weight_kv`` for the version). Imports nothing of the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = ["Span", "VersionSpans", "spans_of"]


@dataclasses.dataclass(frozen=True)
class Span:
    """From generated token ``start`` on (until the next span), the tokens came from ``version``
    (``None``: the engine had no version)."""

    start: int
    version: int | None
    kv: str | None = None
    """On a span after the first: how the KV of the tokens before ``start`` crossed the switch."""


class VersionSpans:
    """One sequence's spans, grown one step's tokens at a time."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self.tokens = 0
        """Generated tokens counted so far."""

    @property
    def spans(self) -> tuple[Span, ...]:
        return tuple(self._spans)

    def add(self, version: int | None, count: int = 1, kv: str | None = None) -> None:
        """Count ``count`` more tokens, all computed with ``version``, which the sequence's KV entered
        as ``kv`` says (read only when this starts a span after the first)."""
        if count < 1:
            return
        if not self._spans:
            self._spans.append(Span(0, version))
        elif self._spans[-1].version != version:
            self._spans.append(Span(self.tokens, version, kv))
        self.tokens += count


def spans_of(versions: Iterable[int | None]) -> tuple[Span, ...]:
    """The spans of a sequence whose generated tokens came from ``versions``, one per token."""
    spans = VersionSpans()
    for version in versions:
        spans.add(version)
    return spans.spans
