"""Shard lifecycle steps against an in-memory API (tests/helpers/kube_fakes.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, reconcile, settings
from megafleet.reconcile import context

GPU = "nvidia.com/gpu"


class Agents(agent_fakes.Agents):
    """Every agent serves version 1; a drain succeeds at once."""

    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [agent_client.AgentState(state="ready", weight_version=1, served_address=f"{ip}:8000") for ip in pod_ips]

    async def suspend(self, pod_ip: str, token: str, *, mode: str, timeout_seconds: float) -> None:
        pass

    async def close(self) -> None:
        pass


def gpu_fleet(pipeline: int) -> dict[str, Any]:
    spec = {
        "model": {"source": "/models/m"},
        "parallelism": {"tensor": 8, "pipeline": pipeline},
        "resources": {"gpusPerNode": 8},
    }
    metadata = {"name": "gen", "namespace": "rl", "uid": "uid-gen", "generation": pipeline}
    return {"apiVersion": "megafleet.dev/v1alpha1", "kind": "MegatronGeneration", "metadata": metadata, "spec": spec}


def test_changing_the_pipeline_size_rolls_the_shard_instead_of_counting_a_failure() -> None:
    """A pipeline change once made the old 2-pod shard "-1 of 1 pods missing" (a restart)."""
    nodes = [
        {"kind": "Node", "metadata": {"name": f"n{i}", "labels": {}}, "spec": {}, "status": {"allocatable": {GPU: "8"}}}
        for i in range(4)
    ]
    api = kube_fakes.Api(gpu_fleet(pipeline=2), *nodes)
    runtime = context.Runtime.of(api, Agents(), settings.OperatorSettings())

    async def reconcile_once() -> dict[str, Any]:
        await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "gen", "rl") or {})
        return await api.get("MegatronGeneration", "gen", "rl") or {}

    asyncio.run(reconcile_once())
    api.run_pods("n0")
    assert asyncio.run(reconcile_once())["status"]["readyReplicas"] == 1
    api.objects[("MegatronGeneration", "rl", "gen")].update(gpu_fleet(pipeline=1))

    rolling = asyncio.run(reconcile_once())["status"]["shards"][0]  # drained and deleted
    placed = asyncio.run(reconcile_once())["status"]["shards"][0]  # placed again, with one pod

    assert rolling == {"index": 0, "restarts": 0, "phase": "Draining"}
    assert placed["restarts"] == 0 and "lastError" not in placed
    assert placed["pods"] == ["gen-s0-p0"]
    assert [name for (kind, _, name) in api.objects if kind == "Pod"] == ["gen-s0-p0"]


def test_placing_several_shards_is_one_event_each_for_endpoints_and_placement() -> None:
    fleet = gpu_fleet(1)
    fleet["spec"]["replicas"] = 4
    nodes = [
        {"kind": "Node", "metadata": {"name": f"n{i}", "labels": {}}, "spec": {}, "status": {"allocatable": {GPU: "8"}}}
        for i in range(4)
    ]
    api = kube_fakes.Api(fleet, *nodes)
    runtime = context.Runtime.of(api, Agents(), settings.OperatorSettings())
    events: list[tuple[str, str, str]] = []

    asyncio.run(reconcile.reconcile(runtime, fleet, notify=lambda *event: events.append(event)))

    assert api.writes["create Pod"] == 4 and api.writes["create Service"] == 1  # one-pod shards: one frontends Service
    assert [(kind, reason) for kind, reason, _ in events] == [
        ("Normal", "EndpointsReserved"),
        ("Normal", "ShardsPlaced"),
    ]
    placed = events[1][2]
    assert [f"shard {shard} on nodes" in placed for shard in range(4)] == [True] * 4


def test_an_event_summary_is_cut_with_the_count_left_out() -> None:
    items = [f"shard {index} on nodes: node-{index:04d}" for index in range(100)]
    message = context.summary(items)
    assert len(message) <= context.SUMMARY_CHARACTERS
    shown = message.count("shard ")
    assert message.endswith(f"; and {100 - shown} more") and 0 < shown < 100
    assert context.summary(items[:2]) == "shard 0 on nodes: node-0000; shard 1 on nodes: node-0001"


def held_fleet(replicas: int, shards: list[int]) -> tuple[kube_fakes.Api, context.Runtime]:
    """A fleet of ``replicas`` one-pod shards and a Joined RefitSession ``grpo`` whose world is ``shards``."""
    nodes = [
        {"kind": "Node", "metadata": {"name": f"n{i}", "labels": {}}, "spec": {}, "status": {"allocatable": {GPU: "8"}}}
        for i in range(4)
    ]
    fleet = gpu_fleet(pipeline=1)
    fleet["spec"]["replicas"] = replicas
    session = {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "RefitSession",
        "metadata": {"name": "grpo", "namespace": "rl"},
        "spec": {"fleetRef": {"name": "gen"}, "shards": shards},
        "status": {"phase": "Joined"},
    }
    api = kube_fakes.Api(fleet, session, *nodes)
    return api, context.Runtime.of(api, Agents(), settings.OperatorSettings())


def held_reconcile(api: Any, runtime: Any) -> dict[str, Any]:
    """One reconcile of the held fleet ``gen``; its object after it."""
    key = ("MegatronGeneration", "rl", "gen")
    asyncio.run(reconcile.reconcile(runtime, api.objects[key]))
    found: dict[str, Any] = api.objects[key]
    return found


def pods_of(api: Any) -> list[str]:
    return sorted(name for kind, _, name in api.objects if kind == "Pod")


def test_a_held_fleet_places_a_lost_shard_and_a_scale_outs_new_one_outside_the_trainers_world() -> None:
    """NeMo's rebuild over the surviving shards holds the fleet with a session of those shards; the
    lost one was left unplaced until the session ended, so no later rebuild could name it again; a
    scale-out's new shard is placed too, Stale until the trainer's next rebuild names it. A lost
    member is not placed again: its session breaks, the trainer rebuilds without it."""
    api, runtime = held_fleet(3, [0, 2])
    key = ("MegatronGeneration", "rl", "gen")

    held_reconcile(api, runtime)
    api.run_pods("n0")
    held_reconcile(api, runtime)
    api.objects[key]["status"]["refit"] = {"session": "grpo"}  # the session controller's hold
    api.objects[key]["spec"]["replicas"] = 4  # a scale-out: shard 3 is outside the world
    del api.objects[("Pod", "rl", "gen-s1-p0")]  # deleted by someone: shard 1 is outside the world
    del api.objects[("Pod", "rl", "gen-s2-p0")]  # a member: its session breaks, it waits for that

    held_reconcile(api, runtime)  # the deletions show: restarts counted
    held = held_reconcile(api, runtime)

    assert pods_of(api) == ["gen-s0-p0", "gen-s1-p0", "gen-s3-p0"]
    assert held["status"]["refit"]["session"] == "grpo"
    assert [s["restarts"] for s in held["status"]["shards"]] == [0, 1, 1, 0]
    message = next(c for c in held["status"]["conditions"] if c["type"] == "RefitSessionHeld")["message"]
    assert (
        message == "RefitSession grpo holds the fleet: spec.replicas 4: shards 1, 3 join at the trainer's next rebuild"
    )

    api.objects[("RefitSession", "rl", "grpo")]["spec"].pop("shards")  # every shard is in its world
    del api.objects[("Pod", "rl", "gen-s1-p0")]
    held_reconcile(api, runtime)
    held_reconcile(api, runtime)
    assert pods_of(api) == ["gen-s0-p0", "gen-s3-p0"]


def test_a_held_fleets_scale_in_removes_the_shards_outside_the_world_and_the_members_at_the_rebuild() -> None:
    api, runtime = held_fleet(3, [0, 2])
    key = ("MegatronGeneration", "rl", "gen")

    held_reconcile(api, runtime)
    api.run_pods("n0")
    held_reconcile(api, runtime)
    api.objects[key]["status"]["refit"] = {"session": "grpo"}
    api.objects[key]["spec"]["replicas"] = 1

    held = held_reconcile(api, runtime)

    assert pods_of(api) == ["gen-s0-p0", "gen-s2-p0"], "shard 1 is outside the world: removed at once"
    message = next(c for c in held["status"]["conditions"] if c["type"] == "RefitSessionHeld")["message"]
    assert message == (
        "RefitSession grpo holds the fleet: spec.replicas 1: shard 2 leaves at the trainer's next rebuild "
        "(its world still names it)"
    )
    reconciling = next(c for c in held["status"]["conditions"] if c["type"] == "Reconciling")
    assert (reconciling["status"], reconciling["message"]) == ("True", "applying spec.replicas 1")

    api.objects[("RefitSession", "rl", "grpo")]["spec"]["shards"] = [0]  # the trainer's rebuild leaves it out
    held = held_reconcile(api, runtime)

    assert pods_of(api) == ["gen-s0-p0"]
    message = next(c for c in held["status"]["conditions"] if c["type"] == "RefitSessionHeld")["message"]
    assert message == "template rolls wait until RefitSession grpo ends; scaling applies at its trainer's rebuilds"
    settled = held_reconcile(api, runtime)  # the next reconcile sees shard 2 gone
    reconciling = next(c for c in settled["status"]["conditions"] if c["type"] == "Reconciling")
    assert reconciling["status"] == "False", "the scale-in is applied"
