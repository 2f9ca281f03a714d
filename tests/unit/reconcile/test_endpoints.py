"""Reserving endpoints at scale: Service creates are bounded across fleets, and a fresh
fleet's Secret and ConfigMap are created without reading them first. Against the in-memory API
(tests/helpers/kube_fakes.py)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, desired, reconcile, settings
from megafleet.api import v1alpha1
from megafleet.fleet_state import ownership
from megafleet.reconcile import context

ROOT = Path(__file__).resolve().parents[3]
SPEC = v1alpha1.MegatronGenerationSpec.model_validate({"model": {"source": "tiny://llama"}})
NODE = {"kind": "Node", "metadata": {"name": "n0", "labels": {}}, "spec": {}, "status": {"allocatable": {}}}


class Agents(agent_fakes.Agents):
    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [agent_client.AgentState(state="loading") for _ in pod_ips]

    async def close(self) -> None:
        pass


def fleet(name: str, replicas: int) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"].update(name=name, namespace="rl", uid=f"uid-{name}")
    manifest["spec"].update(replicas=replicas)
    return manifest


class SlowServices(kube_fakes.Api):
    """Service creates take a while (as kube-apiserver's ClusterIP allocation does); records the
    most in flight at once and the order in which fleets' creates began."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        super().__init__(*objects)
        self.in_flight = 0
        self.most = 0
        self.started: list[str] = []

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] != "Service":
            return await super().create(obj)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        self.started.append(obj["metadata"]["labels"]["megafleet.dev/fleet"])
        try:
            await asyncio.sleep(0.001)
            return await super().create(obj)
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize("bound", [None, 1, 5])
def test_service_creates_across_fleets_stay_within_the_bound_and_fleets_are_served_in_order(bound: int | None) -> None:
    """The bound is the setting (``MEGAFLEET_API_SERVICE_CREATES_IN_FLIGHT``, default 2). 250 shards
    a fleet: three frontends Services (100 shards each)."""
    fleets = [fleet(f"f{index}", replicas=250) for index in range(4)]
    api = SlowServices(*fleets, NODE)
    environ = {} if bound is None else {"MEGAFLEET_API_SERVICE_CREATES_IN_FLIGHT": str(bound)}
    runtime = context.Runtime.of(api, Agents(), settings.OperatorSettings.from_environ(environ))

    async def all_at_once() -> None:
        bodies = [await api.get("MegatronGeneration", f"f{index}", "rl") or {} for index in range(4)]
        await asyncio.gather(*(reconcile.reconcile(runtime, body) for body in bodies))

    asyncio.run(all_at_once())

    assert api.most == (bound or 2)  # the bound is reached, never passed
    assert len([key for key in api.objects if key[0] == "Service"]) == 12
    for index in range(4):  # every fleet reserved and published its endpoints
        status = api.objects[("MegatronGeneration", "rl", f"f{index}")]["status"]
        assert len(status["endpoints"]) == 250
    first_done = [api.started.index(f"f{index}") for index in range(4)]
    assert first_done == sorted(first_done)  # waiters are served in arrival order
    assert api.started[:3] == ["f0"] * 3  # the first fleet's creates were not spread behind the others'


class ReadsApart(kube_fakes.Api):
    """Counts the reconcile's own GETs apart from those the fake's create makes inside."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        super().__init__(*objects)
        self.creating = False
        self.asked: collections.Counter[str] = collections.Counter()

    async def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        if not self.creating:
            self.asked[kind] += 1
        return await super().get(kind, name, namespace)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.creating = True
        try:
            return await super().create(obj)
        finally:
            self.creating = False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def remembering(api: kube_fakes.Api, clock: Clock) -> context.Runtime:
    """A runtime whose memory of the fleets' own objects runs on ``clock``."""
    runtime = context.Runtime.of(api, Agents(), settings.OperatorSettings())
    return dataclasses.replace(runtime, recent=ownership.Recent(clock=clock))


def test_a_fresh_fleet_creates_its_secret_and_configmap_without_reading_them_first() -> None:
    api = ReadsApart(fleet("tiny", replicas=1), NODE)
    clock = Clock()
    runtime = remembering(api, clock)

    async def reconciles() -> None:
        await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "tiny", "rl") or {})
        assert api.asked["Secret"] == 0 and api.asked["ConfigMap"] == 0
        await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "tiny", "rl") or {})
        assert api.asked["Secret"] == 0 and api.asked["ConfigMap"] == 0  # what it made is remembered
        clock.now = ownership.RECENT_SECONDS + 1
        await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "tiny", "rl") or {})
        assert api.asked["Secret"] == 1 and api.asked["ConfigMap"] == 1  # then read again, never created again

    asyncio.run(reconciles())
    assert api.writes["create Secret"] == 1 and api.writes["create ConfigMap"] == 1


def test_a_hand_edited_configmap_is_repaired_once_what_was_remembered_of_it_is_too_old() -> None:
    api = kube_fakes.Api(fleet("tiny", replicas=1), NODE)
    clock = Clock()
    runtime = remembering(api, clock)

    async def reconciled() -> None:
        await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "tiny", "rl") or {})

    asyncio.run(reconciled())
    key = ("ConfigMap", "rl", "tiny-endpoints")
    published = api.objects[key]["data"]
    api.objects[key]["data"] = {"endpoints.json": "[]"}  # kubectl edit
    asyncio.run(reconciled())
    assert api.objects[key]["data"] == {"endpoints.json": "[]"} and api.writes["patch ConfigMap"] == 0
    clock.now = ownership.RECENT_SECONDS + 1
    asyncio.run(reconciled())
    assert api.objects[key]["data"] == published and api.writes["patch ConfigMap"] == 1


def test_what_is_remembered_of_a_deleted_fleets_objects_never_counts_as_a_new_fleets_of_its_name() -> None:
    recent = ownership.Recent(clock=Clock())
    old = desired.agent_secret(desired.ParsedFleet("tiny", "rl", "uid-old", 1, SPEC), "b2xk")
    recent.put("Secret", old)
    api = kube_fakes.Api(fleet("tiny", replicas=1))
    new = desired.ParsedFleet("tiny", "rl", "uid-tiny", 1, SPEC)
    assert asyncio.run(ownership.get(api, new, "Secret", "tiny-agent-token", recent)) is None
    assert api.reads["get Secret"] == 1


def test_a_configmap_left_by_an_earlier_reconcile_is_corrected_by_a_fresh_one() -> None:
    stale = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "tiny-endpoints",
            "namespace": "rl",
            "ownerReferences": [{"kind": "MegatronGeneration", "name": "tiny", "uid": "uid-tiny", "controller": True}],
        },
        "data": {"endpoints.json": "[]"},
    }
    api = kube_fakes.Api(fleet("tiny", replicas=1), NODE, stale)
    runtime = context.Runtime.of(api, Agents(), settings.OperatorSettings())

    async def once() -> None:
        await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "tiny", "rl") or {})

    asyncio.run(once())
    assert "tiny-f0" in str(api.objects[("ConfigMap", "rl", "tiny-endpoints")]["data"])
    assert api.writes["patch ConfigMap"] == 1


def reconciled(api: kube_fakes.Api, replicas: int, events: list[tuple[str, str, str]] | None = None) -> dict[str, Any]:
    """Set ``spec.replicas`` (as ``kubectl scale`` does), reconcile once, return the fleet."""
    api.objects[("MegatronGeneration", "rl", "tiny")]["spec"]["replicas"] = replicas
    runtime = context.Runtime.of(api, Agents(), settings.OperatorSettings())
    notes = events if events is not None else []

    async def once() -> dict[str, Any]:
        body = await api.get("MegatronGeneration", "tiny", "rl") or {}
        await reconcile.reconcile(runtime, body, notify=lambda *event: notes.append(event))
        return await api.get("MegatronGeneration", "tiny", "rl") or {}

    return asyncio.run(once())


def services(api: kube_fakes.Api) -> dict[str, dict[str, Any]]:
    return {name: obj for (kind, _, name), obj in api.objects.items() if kind == "Service"}


def test_scaling_adds_and_removes_shard_ports_and_keeps_every_other_endpoint() -> None:
    api = kube_fakes.Api(fleet("tiny", replicas=2), NODE)
    before = reconciled(api, 2)["status"]["endpoints"]
    assert [e["url"].rsplit(":", 1)[1] for e in before] == ["8000/v1", "8001/v1"]
    assert len({e["url"].split(":")[1] for e in before}) == 1  # one ClusterIP for both shards

    api.writes.clear()
    events: list[tuple[str, str, str]] = []
    grown = reconciled(api, 3, events)["status"]["endpoints"]
    assert grown[:2] == before and grown[2]["url"] == before[0]["url"].replace(":8000/", ":8002/")
    reserved = [message for _, reason, message in events if reason == "EndpointsReserved"]
    assert reserved == [f"shard 2: {grown[2]['url']}"]  # the new shard's port, announced once
    assert api.writes["patch Service"] == 1 and api.writes["create Service"] == 0
    assert [p["name"] for p in services(api)["tiny-f0"]["spec"]["ports"]] == ["shard-0", "shard-1", "shard-2"]

    assert reconciled(api, 1)["status"]["endpoints"] == before[:1]
    assert [p["port"] for p in services(api)["tiny-f0"]["spec"]["ports"]] == [8000]
    reconciled(api, 0)
    assert services(api) == {}


def test_a_fleet_of_250_shards_has_three_frontends_services_and_a_scale_down_removes_the_last() -> None:
    api = kube_fakes.Api(fleet("tiny", replicas=250), NODE)
    endpoints = reconciled(api, 250)["status"]["endpoints"]
    assert sorted(services(api)) == ["tiny-f0", "tiny-f1", "tiny-f2"]
    assert [(e["service"], e["url"].rsplit(":", 1)[1]) for e in endpoints[99:101]] == [
        ("tiny-f0", "8099/v1"),
        ("tiny-f1", "8000/v1"),
    ]
    reconciled(api, 150)
    assert sorted(services(api)) == ["tiny-f0", "tiny-f1"]
    assert len(services(api)["tiny-f1"]["spec"]["ports"]) == 50


def test_a_fleet_with_an_older_operators_shard_services_keeps_them_and_adds_more_of_them() -> None:
    """An operator upgrade changes no published endpoint: a fleet that has one Service per shard
    (made before the frontends Services) keeps that scheme, scaled up too."""
    api = kube_fakes.Api(fleet("tiny", replicas=2), NODE)
    owner = api.objects[("MegatronGeneration", "rl", "tiny")]
    parsed = desired.ParsedFleet(
        "tiny", "rl", owner["metadata"]["uid"], 1, v1alpha1.MegatronGenerationSpec.model_validate(owner["spec"])
    )
    for shard in range(2):
        asyncio.run(api.create(desired.frontend_service(parsed, shard)))
    before = reconciled(api, 2)["status"]["endpoints"]
    assert [e["service"] for e in before] == ["tiny-s0", "tiny-s1"]
    assert reconciled(api, 3)["status"]["endpoints"][:2] == before
    assert sorted(services(api)) == ["tiny-s0", "tiny-s1", "tiny-s2"]


def test_a_fleet_of_two_pod_shards_has_one_ranks_service_and_an_older_operators_shard_ones_last_their_shard() -> None:
    manifest = fleet("tiny", replicas=3)
    manifest["spec"].update(
        parallelism={"tensor": 2},
        resources={"gpusPerNode": 1, "cpu": "1", "memory": "1Gi"},
        engine={"backend": "megatron"},
        model={"source": "tiny://llama", "dtype": "bfloat16"},
    )
    api = kube_fakes.Api(manifest, NODE)
    owner = api.objects[("MegatronGeneration", "rl", "tiny")]
    for shard in range(3):  # what an operator before the fleet's ranks Service made
        older = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": f"tiny-s{shard}-ranks",
                "namespace": "rl",
                "labels": {"megafleet.dev/fleet": "tiny", "megafleet.dev/shard": str(shard)},
                "ownerReferences": [
                    {"kind": "MegatronGeneration", "name": "tiny", "uid": owner["metadata"]["uid"], "controller": True}
                ],
            },
            "spec": {"clusterIP": "None", "ports": [{"name": "rendezvous", "port": 29500}]},
        }
        asyncio.run(api.create(older))

    reconciled(api, 3)
    assert sorted(services(api)) == ["tiny-f0", "tiny-ranks", "tiny-s0-ranks", "tiny-s1-ranks", "tiny-s2-ranks"]
    reconciled(api, 1)  # the removed shards' own ranks Services go, the live one's stays
    assert sorted(services(api)) == ["tiny-f0", "tiny-ranks", "tiny-s0-ranks"]
    reconciled(api, 0)
    assert services(api) == {}
