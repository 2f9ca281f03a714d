"""Limits of the engine's OpenAI frontend that its clients rely on, defined once.

The engine enforces them (:mod:`megafleet_engine.openai.protocol`, :mod:`megafleet_engine.openai.serving`)
and the SDK sizes its batched requests by them (:mod:`megafleet.sdk.generation`).
"""

from __future__ import annotations

__all__ = ["MAX_SEQUENCES_PER_REQUEST"]

MAX_SEQUENCES_PER_REQUEST = 128
"""Most sequences one completion request may ask for: prompts times ``n`` (each is a sequence in
the engine's batch; OpenAI's own limit on ``n``)."""
