"""The fixture the Refit and RefitSession controllers' tests share."""

from __future__ import annotations

import pytest

from helpers.refit_world import World


@pytest.fixture
def world() -> World:
    """A fleet of two one-rank shards, reconciled once, its pods running."""
    found = World()
    found.start()
    return found
