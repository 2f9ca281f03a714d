"""The watch-fed cache (megafleet.reconcile.cache): reconciles read their fleet, its pods, Services
and nodes from Kopf indexes, see their own writes before the watch delivers them, and GET and LIST
nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, handlers, reconcile, settings
from megafleet.fleet_state import pods as pod_view
from megafleet.reconcile import cache, context

ROOT = Path(__file__).resolve().parents[3]
GPU = "nvidia.com/gpu"


class ReadyAgents(agent_fakes.Agents):
    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [agent_client.AgentState(state="ready", weight_version=1, served_address=f"{ip}:8000") for ip in pod_ips]

    async def close(self) -> None:
        pass


def gpu_fleet(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "MegatronGeneration",
        "metadata": {"name": name, "namespace": "rl"},
        "spec": {
            "model": {"source": "/models/llama-8b"},
            "replicas": 1,
            "parallelism": {"tensor": 8},
            "resources": {"gpusPerNode": 8},
        },
    }


def gpu_node(name: str) -> dict[str, Any]:
    return {"kind": "Node", "metadata": {"name": name, "labels": {}}, "spec": {}, "status": {"allocatable": {GPU: "8"}}}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cached_runtime(api: kube_fakes.Api, indexes: kube_fakes.Indexes, clock: Clock | None = None) -> context.Runtime:
    watched = cache.Cache(clusterwide=True, clock=clock or Clock())
    watched.attach(indexes)
    return context.Runtime.of(api, ReadyAgents(), settings.OperatorSettings(), cache=watched)


def reconcile_fleet(runtime: context.Runtime, api: kube_fakes.Api, name: str) -> None:
    body = asyncio.run(api.get("MegatronGeneration", name, "rl")) or {}
    asyncio.run(reconcile.reconcile(runtime, body))


def test_placement_counts_pods_the_watch_has_not_delivered_and_lists_nothing() -> None:
    api = kube_fakes.Api(gpu_fleet("a"), gpu_fleet("b"), gpu_node("n0"), gpu_node("n1"))
    indexes = kube_fakes.Indexes(api)  # the watch delivers nothing more during this test
    runtime = cached_runtime(api, indexes)

    reconcile_fleet(runtime, api, "a")
    reconcile_fleet(runtime, api, "b")

    pods = [obj for (kind, _, _), obj in api.objects.items() if kind == "Pod"]
    pinned = sorted(pod_view.pinned_node(pod) or "" for pod in pods)
    assert pinned == ["n0", "n1"]  # b did not get a's node although the watch never showed a's pod
    assert not any(verb.startswith("list") for verb in api.reads)
    assert api.writes["create Pod"] == 2


def test_a_reconcile_sees_its_own_creations_and_does_not_create_twice() -> None:
    api = kube_fakes.Api(gpu_fleet("a"), gpu_node("n0"))
    runtime = cached_runtime(api, kube_fakes.Indexes(api))

    reconcile_fleet(runtime, api, "a")
    api.writes.clear()
    reconcile_fleet(runtime, api, "a")  # the watch still shows no pod and no Service

    assert api.writes == {}


def test_an_own_deletion_shows_the_pod_deleting_until_the_watch_shows_it() -> None:
    api = kube_fakes.Api(gpu_fleet("a"), gpu_node("n0"))
    indexes = kube_fakes.Indexes(api)
    clock = Clock()
    runtime = cached_runtime(api, indexes, clock)
    reconcile_fleet(runtime, api, "a")
    indexes.sync()
    assert runtime.cache is not None
    (pod,) = runtime.cache.fleet_objects("Pod", "rl", "a")

    asyncio.run(api.delete("Pod", pod["metadata"]["name"], "rl"))

    (shown,) = runtime.cache.fleet_objects("Pod", "rl", "a")
    assert shown["metadata"].get("deletionTimestamp")
    indexes.sync()  # the watch delivers the deletion
    assert runtime.cache.fleet_objects("Pod", "rl", "a") == []
    assert not [key for key in runtime.cache.pending if key[0] == "Pod"]


def test_an_own_creation_the_watch_never_confirms_expires() -> None:
    api = kube_fakes.Api(gpu_fleet("a"), gpu_node("n0"))
    indexes = kube_fakes.Indexes(api)
    clock = Clock()
    runtime = cached_runtime(api, indexes, clock)
    reconcile_fleet(runtime, api, "a")
    assert runtime.cache is not None
    assert len(runtime.cache.fleet_objects("Pod", "rl", "a")) == 1
    live = runtime.cache.live_pods()
    assert live is not None and len(live) == 1

    clock.now += cache.PENDING_SECONDS + 1

    assert runtime.cache.fleet_objects("Pod", "rl", "a") == []
    assert runtime.cache.live_pods() == []


def test_an_operator_watching_some_namespaces_lists_the_clusters_pods_at_placement() -> None:
    api = kube_fakes.Api(gpu_fleet("a"), gpu_node("n0"))
    watched = cache.Cache(clusterwide=False)
    watched.attach(kube_fakes.Indexes(api))
    runtime = context.Runtime.of(api, ReadyAgents(), settings.OperatorSettings(), cache=watched)

    reconcile_fleet(runtime, api, "a")

    assert api.reads["list Pod"] == 1 and "list Node" not in api.reads and "list Service" not in api.reads


def test_an_own_creation_is_confirmed_by_the_index_it_is_read_from_or_forgotten_on_deletion() -> None:
    api = kube_fakes.Api(gpu_fleet("a"), gpu_fleet("b"), gpu_node("n0"), gpu_node("n1"))
    indexes = kube_fakes.Indexes(api)
    runtime = cached_runtime(api, indexes)
    reconcile_fleet(runtime, api, "a")
    assert runtime.cache is not None
    (pod,) = [obj for (kind, _, _), obj in api.objects.items() if kind == "Pod"]
    key = ("Pod", "rl", pod["metadata"]["name"])
    assert key in runtime.cache.pending

    indexes.sync()
    assert runtime.cache.live_pods() == [cache.slim_pod(pod)]  # the index has it: the overlay ends
    assert key not in runtime.cache.pending

    reconcile_fleet(runtime, api, "b")  # b's pod: created, then deleted by someone else
    (other,) = [obj for (kind, _, name), obj in api.objects.items() if kind == "Pod" and name.startswith("b-")]
    del api.objects[("Pod", "rl", other["metadata"]["name"])]
    indexes.sync()  # the watch delivered both events: the index never shows it
    assert len(runtime.cache.fleet_objects("Pod", "rl", "b")) == 1  # still the overlay ...
    runtime.cache.forget("Pod", other)  # ... until the DELETED event's handler runs
    assert runtime.cache.fleet_objects("Pod", "rl", "b") == []
    assert runtime.cache.live_pods() == [cache.slim_pod(pod)]


def test_the_watch_delivering_an_own_write_takes_it_out_of_the_overlay_without_a_read() -> None:
    api = kube_fakes.Api(gpu_fleet("a"), gpu_node("n0"))
    indexes = kube_fakes.Indexes(api)
    runtime = cached_runtime(api, indexes)
    reconcile_fleet(runtime, api, "a")
    assert runtime.cache is not None
    (pod,) = [obj for (kind, _, _), obj in api.objects.items() if kind == "Pod"]
    (service,) = [obj for (kind, _, _), obj in api.objects.items() if kind == "Service"]
    assert len(runtime.cache.pending) == 2  # the pod and the frontend Service (no ranks Service: one pod)

    runtime.cache.delivered("Pod", {**pod, "metadata": {**pod["metadata"], "uid": "someone-elses"}})
    assert len(runtime.cache.pending) == 2  # another object of that name confirms nothing
    runtime.cache.delivered("Pod", pod)
    runtime.cache.delivered("Service", service)
    assert runtime.cache.pending == {}

    asyncio.run(api.delete("Pod", pod["metadata"]["name"], "rl"))  # an own deletion ...
    api.objects[("Pod", "rl", pod["metadata"]["name"])] = pod  # ... that the API server has not begun
    runtime.cache.delivered("Pod", pod)  # an event of the pod from before the deletion
    assert len(runtime.cache.pending) == 1
    runtime.cache.delivered("Pod", {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "now"}})
    assert runtime.cache.pending == {}


def test_a_pod_deleted_by_someone_else_counts_one_restart_although_seen_terminating_first() -> None:
    api = kube_fakes.Api(gpu_fleet("a"), gpu_node("n0"))
    indexes = kube_fakes.Indexes(api)
    runtime = cached_runtime(api, indexes)

    def restarts() -> int:
        reconcile_fleet(runtime, api, "a")
        indexes.sync()
        status = (asyncio.run(api.get("MegatronGeneration", "a", "rl")) or {})["status"]
        return int(status["shards"][0]["restarts"])

    assert restarts() == 0
    api.run_pods("n0")
    indexes.sync()
    assert restarts() == 0
    key = next(key for key in api.objects if key[0] == "Pod")
    api.objects[key]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"  # the watch shows it going
    indexes.sync()
    assert [restarts(), restarts()] == [1, 1]
    del api.objects[key]
    indexes.sync()
    assert [restarts(), restarts()] == [1, 1]  # placed again, counted once
    assert api.writes["create Pod"] == 2


class SlowPodCreates(kube_fakes.Api):
    """Pod creates that wait for ``gate``, as an API server under load answers them."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        super().__init__(*objects)
        self.gate = asyncio.Event()

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Pod":
            await self.gate.wait()
        return await super().create(obj)


def test_a_placement_plans_while_another_fleets_pod_creates_are_in_flight() -> None:
    api = SlowPodCreates(gpu_fleet("a"), gpu_fleet("b"), gpu_node("n0"), gpu_node("n1"))
    indexes = kube_fakes.Indexes(api)
    runtime = cached_runtime(api, indexes)
    watched = runtime.cache
    assert watched is not None

    async def scenario() -> None:
        bodies = [await api.get("MegatronGeneration", name, "rl") or {} for name in ("a", "b")]
        both = asyncio.gather(*(reconcile.reconcile(runtime, body) for body in bodies))
        while len(watched.reserved) < 2:  # both planned, neither pod created yet
            await asyncio.sleep(0.01)
        assert not runtime.placement_lock.locked()
        assert sorted(pod_view.pinned_node(pod) or "" for pod in watched.reserved.values()) == ["n0", "n1"]
        api.gate.set()
        await both

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))

    assert watched.reserved == {}  # released once the creates returned
    pods = [obj for (kind, _, _), obj in api.objects.items() if kind == "Pod"]
    assert sorted(pod_view.pinned_node(pod) or "" for pod in pods) == ["n0", "n1"]


# -- the fleet itself: the watch's copy or the operator's own last write, whichever is newer ---------


def test_resource_versions_compare_as_integers_or_not_at_all() -> None:
    assert cache.compare_versions("9", "10") == -1 and cache.compare_versions("10", "9") == 1
    assert cache.compare_versions("123", "123") == 0
    for odd in ("", None, "007", "12a", "-3", "١٢"):  # not a positive integer as KEP-5504 writes them
        assert cache.compare_versions(odd, "5") is None and cache.compare_versions("5", odd) is None


def test_a_reconcile_reads_its_fleet_from_the_index_not_the_api_server() -> None:
    api = kube_fakes.Api(gpu_fleet("a"), gpu_node("n0"))
    runtime = cached_runtime(api, kube_fakes.Indexes(api))

    found = asyncio.run(handlers._fleet(runtime, "rl", "a"))  # what the handlers' reconcile reads

    assert found is not None and found["spec"]["replicas"] == 1
    assert "get MegatronGeneration" not in api.reads
    assert asyncio.run(handlers._fleet(runtime, "rl", "b")) is None  # not indexed: read, and not there
    assert api.reads["get MegatronGeneration"] == 1


def watched_fleet() -> tuple[kube_fakes.Api, kube_fakes.Indexes, cache.Cache]:
    """Fleet ``a`` on a fake API server, its indexes, and the cache a runtime over them reads."""
    api = kube_fakes.Api(gpu_fleet("a"))
    indexes = kube_fakes.Indexes(api)
    runtime = cached_runtime(api, indexes)
    assert runtime.cache is not None
    return api, indexes, runtime.cache


def test_the_own_last_write_counts_until_the_watch_delivers_it_or_something_newer() -> None:
    api, indexes, watched = watched_fleet()

    asyncio.run(api.patch_status("MegatronGeneration", "a", "rl", {"replicas": 1}))  # resourceVersion 2
    seen = watched.fleet("rl", "a")
    assert seen is not None and seen["status"] == {"replicas": 1}  # the watch still shows version 1
    seen["status"]["replicas"] = 99  # a copy: the caller may change it
    assert (watched.fleet("rl", "a") or {})["status"] == {"replicas": 1}

    indexes.sync()  # the watch delivered version 2: the overlay ends
    assert (watched.fleet("rl", "a") or {})["status"] == {"replicas": 1} and watched.fleet_writes == {}

    asyncio.run(api.patch_status("MegatronGeneration", "a", "rl", {"readyReplicas": 1}))  # version 3, own
    api.objects[("MegatronGeneration", "rl", "a")]["spec"]["replicas"] = 2  # someone's edit: version 4
    api.objects[("MegatronGeneration", "rl", "a")]["metadata"]["resourceVersion"] = "4"
    indexes.sync()
    newest = watched.fleet("rl", "a") or {}
    assert newest["spec"]["replicas"] == 2 and newest["status"]["readyReplicas"] == 1
    assert watched.fleet_writes == {}


def test_a_fleet_the_index_does_not_hold_or_whose_versions_do_not_compare_is_read() -> None:
    api, indexes, watched = watched_fleet()

    asyncio.run(api.patch_status("MegatronGeneration", "a", "rl", {"replicas": 1}))
    indexed = indexes[cache.FLEETS][("rl", "a")][0]
    indexed["metadata"]["resourceVersion"] = "v1"  # an API server whose versions are not integers
    assert watched.fleet("rl", "a") is None

    del api.objects[("MegatronGeneration", "rl", "a")]
    indexes.sync()  # deleted: the index no longer holds it, and the own write is dropped
    assert watched.fleet("rl", "a") is None and watched.fleet_writes == {}

    api, indexes, watched = watched_fleet()
    asyncio.run(api.patch_status("MegatronGeneration", "a", "rl", {"replicas": 1}))
    indexes[cache.FLEETS][("rl", "a")][0]["metadata"]["uid"] = "uid-new"  # deleted and made again
    found = watched.fleet("rl", "a") or {}
    assert found["metadata"]["uid"] == "uid-new" and "status" not in found
