"""The peering announcement (:mod:`megafleet.peering`): the heartbeat is the one Kopf writes and reads,
it is written before the settle wait, and a missing peering object is reported, not raised."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import pytest
from kopf._core.engines import peering as kopf_peering
from lightkube.core.exceptions import ApiError
from lightkube.models import meta_v1

from megafleet import peering


class FakeClient:
    def __init__(self, missing: bool = False) -> None:
        self.missing = missing
        self.patches: list[tuple[str, dict[str, Any], float]] = []

    async def patch(self, resource: object, name: str, body: dict[str, Any], **_: Any) -> None:
        if self.missing:
            raise ApiError(status=meta_v1.Status(code=404, message="not found"))
        self.patches.append((name, body, asyncio.get_running_loop().time()))


def test_the_heartbeat_is_a_live_kopf_peer_of_that_priority() -> None:
    now = datetime.datetime.now(datetime.UTC)
    peer = kopf_peering.Peer(identity=kopf_peering.Identity("me"), **peering.heartbeat(7, 20, now))
    assert peer.priority == 7 and not peer.is_dead
    assert peer.lifetime == datetime.timedelta(seconds=20)


def test_announce_writes_the_heartbeat_then_settles() -> None:
    client = FakeClient()

    async def run() -> tuple[bool, float]:
        announced = await peering.announce(
            "p",
            "me",
            priority=3,
            lifetime=20,
            settle_seconds=0.2,
            client=client,  # type: ignore[arg-type]
        )
        return announced, asyncio.get_running_loop().time()

    announced, ended = asyncio.run(run())
    assert announced
    [(name, body, written)] = client.patches
    assert name == "p" and body["status"]["me"]["priority"] == 3 and body["status"]["me"]["lifetime"] == 20
    assert ended - written >= 0.2


def test_announce_without_the_peering_object_reports_it() -> None:
    announced = asyncio.run(
        peering.announce("p", "me", priority=1, lifetime=20, settle_seconds=0, client=FakeClient(missing=True))  # type: ignore[arg-type]
    )
    assert announced is False


def test_identities_are_unique() -> None:
    assert peering.new_identity() != peering.new_identity()


@pytest.mark.parametrize("priority", [0, 2**31 - 1])
def test_heartbeat_round_trips_any_priority(priority: int) -> None:
    entry = peering.heartbeat(priority, 20, datetime.datetime.now(datetime.UTC))
    assert kopf_peering.Peer(identity=kopf_peering.Identity("x"), **entry).priority == priority
