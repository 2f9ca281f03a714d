"""A status write is made only when merging it changes something."""

from __future__ import annotations

from typing import Any

import pytest

from megafleet.fleet_state import patches


@pytest.mark.parametrize(
    ("current", "update", "expected"),
    [
        ({}, {}, True),
        ({"a": 1, "b": [1, 2]}, {"b": [1, 2]}, True),
        ({"a": 1}, {"a": 2}, False),
        ({"a": 1}, {"c": None}, False),
    ],
    ids=["empty", "same-subset", "changed", "new-key"],
)
def test_unchanged(current: dict[str, Any], update: dict[str, Any], expected: bool) -> None:
    assert patches.unchanged(current, update) is expected
