"""Shards on a lost node (megafleet.reconcile.lost_nodes): when a node counts as lost (deleted, unreachable
past the pod's toleration, out of service), and a reconcile that force-deletes the shard's pods at
once and re-places it on a remaining node behind the same Services, with the node named."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, reconcile, settings
from megafleet.fleet_state import pods as pod_view
from megafleet.reconcile import cache, context, lost_nodes

NOW = datetime.datetime(2026, 12, 2, 1, 0, 0, tzinfo=datetime.UTC)
DEFAULT: list[dict[str, Any]] = [
    {"key": lost_nodes.UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
]
"""What the API server's DefaultTolerationSeconds admission adds to a pod without its own."""


def node(name: str, *taints: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": {}},
        "spec": {"taints": list(taints)},
        "status": {"allocatable": {"nvidia.com/gpu": "8"}},
    }


def taint(key: str, seconds_ago: float) -> dict[str, Any]:
    added = (NOW - datetime.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"key": key, "effect": "NoExecute", "timeAdded": added}


def by_name(*found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["metadata"]["name"]: n for n in found}


def test_a_deleted_node_is_lost_at_once() -> None:
    assert lost_nodes.loss("n1", by_name(node("n0")), DEFAULT, NOW) == lost_nodes.Loss("n1", "deleted")
    assert str(lost_nodes.loss("n1", {}, DEFAULT, NOW)) == "node n1 deleted"


def test_an_unreachable_node_is_lost_when_the_pods_toleration_runs_out() -> None:
    assert lost_nodes.loss("n0", by_name(node("n0", taint(lost_nodes.UNREACHABLE, 299))), DEFAULT, NOW) is None
    lost = lost_nodes.loss("n0", by_name(node("n0", taint(lost_nodes.UNREACHABLE, 300))), DEFAULT, NOW)
    assert lost is not None and lost.why == "unreachable since 2026-12-02T00:55:00Z"


def test_no_toleration_means_at_once_and_one_without_seconds_means_never() -> None:
    fresh = by_name(node("n0", taint(lost_nodes.UNREACHABLE, 0)))
    assert lost_nodes.loss("n0", fresh, [], NOW) is not None
    forever: list[dict[str, Any]] = [{"operator": "Exists"}]  # an empty key with Exists tolerates every taint, for ever
    assert lost_nodes.loss("n0", by_name(node("n0", taint(lost_nodes.UNREACHABLE, 10**6))), forever, NOW) is None
    longest: list[dict[str, Any]] = [
        {**DEFAULT[0], "tolerationSeconds": 30},
        {"key": lost_nodes.UNREACHABLE, "operator": "Exists"},
    ]
    assert lost_nodes.loss("n0", by_name(node("n0", taint(lost_nodes.UNREACHABLE, 10**6))), longest, NOW) is None


def test_not_ready_is_left_to_kubernetes_and_out_of_service_is_lost() -> None:
    not_ready = by_name(node("n0", taint("node.kubernetes.io/not-ready", 10**6)))
    assert lost_nodes.loss("n0", not_ready, [], NOW) is None
    out = lost_nodes.loss("n0", by_name(node("n0", taint(lost_nodes.OUT_OF_SERVICE, 0))), DEFAULT, NOW)
    assert out is not None and out.why.startswith("out of service since ")
    no_start = by_name(node("n0", {"key": lost_nodes.UNREACHABLE, "effect": "NoExecute"}))
    assert lost_nodes.loss("n0", no_start, [], NOW) is None


def pod(name: str, shard: int, *, bound: str = "", pinned: str = "", deleting: bool = False) -> dict[str, Any]:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": pod_view.HOSTNAME_LABEL, "operator": "In", "values": [pinned]}]}
                ]
            }
        }
    }
    metadata: dict[str, Any] = {"name": name, "labels": {"megafleet.dev/shard": str(shard)}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-02T00:59:00Z"
    spec = {"nodeName": bound, "tolerations": DEFAULT, **({"affinity": affinity} if pinned else {})}
    return {"metadata": metadata, "spec": spec}


def test_lost_shards_names_the_pods_on_lost_nodes_and_the_others() -> None:
    pods = [
        pod("a-s0-p0", 0, bound="n0"),
        pod("a-s1-p0", 1, bound="n1"),
        pod("a-s1-p1", 1, bound="n0"),
        pod("a-s2-p0", 2, pinned="n1"),  # not bound yet: its pinned node counts
        pod("a-s3-p0", 3, bound="n1", deleting=True),  # evicted, stuck Terminating
        pod("a-s4-p0", 4),  # on no node yet
    ]
    found = lost_nodes.lost_shards(pods, {"n0": node("n0")}, NOW)
    assert [(s.shard, sorted(s.lost), s.others) for s in found] == [
        (1, ["a-s1-p0"], ["a-s1-p1"]),
        (2, ["a-s2-p0"], []),
        (3, ["a-s3-p0"], []),
    ]
    assert lost_nodes.lost_shards(pods[:1], {"n0": node("n0")}, NOW) == []
    assert lost_nodes.lost_shards(pods, {}, NOW) == [], "an empty node index is no proof that every node is gone"


class Agents(agent_fakes.Agents):
    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [agent_client.AgentState(state="ready", weight_version=0, served_address=f"{ip}:8000") for ip in pod_ips]

    async def close(self) -> None:
        pass


def fleet() -> dict[str, Any]:
    return {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "MegatronGeneration",
        "metadata": {"name": "a", "namespace": "rl", "uid": "uid-a", "generation": 1},
        "spec": {
            "model": {"source": "/models/m"},
            "replicas": 2,
            "parallelism": {"tensor": 8},
            "resources": {"gpusPerNode": 8},
        },
    }


def run_pinned(api: kube_fakes.Api) -> None:
    """The scheduler and kubelet: bind each new pod to the node it is pinned to and run it."""
    for (kind, _, _), obj in api.objects.items():
        if kind == "Pod" and not obj["spec"].get("nodeName"):
            obj["spec"]["nodeName"] = pod_view.pinned_node(obj)
            obj["status"] = {"phase": "Running", "podIP": f"127.0.1.{len(api.objects)}"}


def test_a_deleted_nodes_shard_is_force_deleted_and_re_placed_behind_the_same_service() -> None:
    api = kube_fakes.Api(fleet(), node("n0"), node("n1"), node("n2"))
    indexes = kube_fakes.Indexes(api)
    watched = cache.Cache(clusterwide=True)
    watched.attach(indexes)
    runtime = context.Runtime.of(api, Agents(), settings.OperatorSettings(), cache=watched)
    events: list[tuple[str, str, str]] = []

    def reconcile_once() -> dict[str, Any]:
        body = asyncio.run(api.get("MegatronGeneration", "a", "rl")) or {}
        asyncio.run(reconcile.reconcile(runtime, body, notify=lambda *event: events.append(event)))
        run_pinned(api)
        indexes.sync()  # the watch catches up
        status: dict[str, Any] = (asyncio.run(api.get("MegatronGeneration", "a", "rl")) or {})["status"]
        return status

    reconcile_once()
    settled = reconcile_once()
    assert settled["readyReplicas"] == 2
    lost = settled["shards"][1]["nodes"][0]
    services = {name: obj["metadata"].get("uid") for (kind, _, name), obj in api.objects.items() if kind == "Service"}
    parsed = runtime.observed[("rl", "a")].fleet
    assert not lost_nodes.due(watched, parsed)

    del api.objects[("Node", None, lost)]
    indexes.sync()
    assert lost_nodes.due(watched, parsed)  # the settled fleet's probe starts a reconcile
    assert lost_nodes.fleets_on(watched, lost) == [("rl", "a")]
    released = reconcile_once()

    pod_deletes = [grace for (kind, _, _), grace in api.memory.deleted if kind == "Pod"]
    assert api.writes["delete Pod"] == 1 and pod_deletes == [0]  # force-deleted: grace 0
    assert released["shards"][1] == {
        "index": 1,
        "restarts": 1,
        "phase": "Draining",
        "lastError": f"node {lost} deleted",
    }
    assert [e for e in events if e[1] == "NodeLost"] == [
        ("Warning", "NodeLost", f"shard 1 is re-placed (restart 1): node {lost} deleted; pods force-deleted: a-s1-p0")
    ]
    placed = reconcile_once()
    replaced = reconcile_once()

    assert placed["shards"][1]["nodes"] not in ([lost], [settled["shards"][0]["nodes"][0]])
    assert replaced["readyReplicas"] == 2 and replaced["shards"][1]["restarts"] == 1
    assert [e for e in events if e[1] == "NodeLost"][1:] == []
    now = {name: obj["metadata"].get("uid") for (kind, _, name), obj in api.objects.items() if kind == "Service"}
    assert now == services
