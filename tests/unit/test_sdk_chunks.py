"""How the SDK splits a completion batch into batched requests: near-equal consecutive chunks, at
least one per frontend, none above the engine's per-request bound."""

from __future__ import annotations

import pytest

from megafleet.sdk import generation
from megafleet_protocol import frontend


@pytest.mark.parametrize(
    ("count", "frontends", "sizes"),
    [
        (0, 2, []),
        (1, 4, [1]),
        (10, 2, [5, 5]),
        (11, 3, [4, 4, 3]),
        (256, 1, [128, 128]),
        (257, 1, [86, 86, 85]),
        (1024, 2, [128] * 8),
        (1000, 16, [63] * 8 + [62] * 8),
    ],
    ids=["empty", "fewer-prompts-than-frontends", "even", "uneven", "bound", "bound-plus-one", "1024", "many"],
)
def test_chunks(count: int, frontends: int, sizes: list[int]) -> None:
    pieces = generation.chunks(count, frontends)
    assert [len(piece) for piece in pieces] == sizes
    assert [index for piece in pieces for index in piece] == list(range(count))
    assert all(len(piece) <= frontend.MAX_SEQUENCES_PER_REQUEST for piece in pieces)
