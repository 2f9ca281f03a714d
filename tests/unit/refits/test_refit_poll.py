"""The Refit timer's pace: fast while the Refit runs (its members may wait staged for the operator's
commit), the base pace while it waits for its fleet or its trainer."""

from __future__ import annotations

import pytest

from megafleet import settings


@pytest.mark.parametrize(
    ("phase", "seconds"),
    [("Running", 0.2), ("Pending", 1.0), ("", 1.0)],
)
def test_the_timer_polls_a_running_refit_five_times_as_often(phase: str, seconds: float) -> None:
    assert settings.RefitSettings().next_poll_seconds(phase) == seconds


def test_both_paces_are_settings() -> None:
    tuned = settings.RefitSettings(poll_seconds=2.0, running_poll_seconds=0.5)
    assert (tuned.next_poll_seconds("Running"), tuned.next_poll_seconds("Pending")) == (0.5, 2.0)
