"""The Kopf supervisor (:mod:`megafleet.supervision`): Kopf's "unresolved resources" warning stops and
restarts it after a back-off; a run that ends by itself ends the supervisor."""

from __future__ import annotations

import asyncio
import logging

import pytest

from megafleet import supervision


def test_a_run_that_loses_its_resources_is_restarted_and_a_normal_stop_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervision, "FIRST_BACKOFF_SECONDS", 0.01)
    runs: list[str] = []

    async def run_kopf(stop: asyncio.Event) -> None:
        runs.append("started")
        if len(runs) == 1:
            logging.getLogger(supervision.KOPF_OBSERVER_LOGGER).warning(
                "Unresolved resources cannot be served (try creating their CRDs): megatrongenerations"
            )
            await stop.wait()  # Kopf stops when the supervisor sets its stop flag
            runs.append("stopped")

    restarts = asyncio.run(asyncio.wait_for(supervision.supervise(run_kopf), timeout=10))
    assert restarts == 1
    assert runs == ["started", "stopped", "started"]


def test_other_warnings_do_not_restart() -> None:
    async def run_kopf(stop: asyncio.Event) -> None:
        logging.getLogger(supervision.KOPF_OBSERVER_LOGGER).warning("Not enough permissions to watch for resources")
        await asyncio.sleep(0.05)

    assert asyncio.run(asyncio.wait_for(supervision.supervise(run_kopf), timeout=10)) == 0
