"""The fleet's default staging (``auto``) on the tiny transformers backend on the CPU, decided at the
engine's start (:func:`megafleet_engine.refit_attempts.staging_memory.plan`): with room the backend
holds a copy of its parameters; without room (a headroom past any machine's memory) it allocates
nothing, says why, and a keep refit asking for ``auto`` writes in place with that reason, never
failing (only ``required`` fails)."""

from __future__ import annotations

import pytest

from helpers import keep_harness as harness
from megafleet_engine.refit_attempts import modes, staging_memory

NO_ROOM_HEADROOM = 2**50
"""1 PiB of headroom: more than any machine running the tests has free."""


def test_auto_with_room_allocates_a_copy_of_the_parameters() -> None:
    backend = harness.fresh_backend()
    plan = staging_memory.plan(backend, "auto", device="cpu", headroom_bytes=0)

    assert plan.bytes == backend.staging_bytes() > 0 and plan.reason is None
    assert set(backend.staged_parameters()) == set(backend.parameters())


def test_auto_without_room_writes_in_place_and_says_why() -> None:
    backend = harness.fresh_backend()
    plan = staging_memory.plan(backend, "auto", device="cpu", headroom_bytes=NO_ROOM_HEADROOM)

    assert plan.bytes is None and plan.reason is not None and plan.reason.startswith("needs ")
    with pytest.raises(RuntimeError, match="no staging copy"):
        backend.staged_parameters()
    auto = modes.resolve(
        in_flight="keep",
        kv_cache_mode="persist",
        staging="auto",
        backend="transformers",
        keep_modes=backend.keep_modes,
        copy=plan,
    )
    required = modes.resolve(
        in_flight="keep",
        kv_cache_mode="persist",
        staging="required",
        backend="transformers",
        keep_modes=backend.keep_modes,
        copy=plan,
    )

    assert (auto.keep, auto.staged, auto.unavailable) == (True, False, None)
    assert (auto.staging.requested, auto.staging.effective, auto.staging.reason) == ("auto", "inPlace", plan.reason)
    assert required.unavailable is not None and required.unavailable.startswith("StagingUnavailable: ")
