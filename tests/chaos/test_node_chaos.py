"""A node lost under a serving fleet (docs/development.md#chaos-drills-and-the-soak): the simulated
node that holds shard 1 goes NotReady (KWOK stops managing it and its Ready condition turns False),
then is deleted.

While it is NotReady its engines still run (the node is simulated), so the fleet keeps serving (the
pods tolerate the node lifecycle controller's taints for 300 s), and a scale-up must place the new
shard elsewhere. Once the node is deleted, the operator itself (``megafleet.reconcile.lost_nodes``)
force-deletes its pods and re-places their shards on the remaining node, behind the same Services,
with a ``NodeLost`` Event naming the node: well before Kubernetes' pod garbage collector would have
removed the orphans (its 40 s quarantine alone; about 100 s measured before). No client request
fails or is mixed, and the fleet converges with nothing orphaned. The node is re-created at the end
(the control plane is shared by the test session)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml

from chaos import drill as drill_module
from helpers import operators as operators_module
from helpers import refit_e2e as base
from megafleet.objects import Object
from megafleet_dev import cluster, kube, nodes, runner

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]

FLEET = drill_module.FLEET
POD_GC_QUARANTINE_SECONDS = 40
"""Kubernetes' pod garbage collector leaves the pods of a deleted node alone for this long (then
force-deletes them at its next sweep): the operator must have re-placed the shard before it."""


def _not_ready(kube_admin: kube.Kube, node: str) -> None:
    """Take ``node`` from KWOK (its annotation no longer matches) and report it NotReady, as the
    node lifecycle controller sees a kubelet that stopped posting a healthy status."""
    kube_admin.patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": {nodes.KWOK_ANNOTATION: "chaos-lost"}}})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    condition = {
        "type": "Ready",
        "status": "False",
        "reason": "ChaosDrill",
        "message": "the chaos drill took this node away",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    kube_admin.patch(f"/api/v1/nodes/{node}/status", {"status": {"conditions": [condition]}}, merge=False)


def _tainted(node: Object | None) -> bool:
    return any(t["key"].startswith("node.kubernetes.io/") for t in (node or {}).get("spec", {}).get("taints") or [])


def _services(kube_admin: kube.Kube, namespace: str) -> dict[str, str]:
    items = kube_admin.list(f"/api/v1/namespaces/{namespace}/services", label_selector=f"megafleet.dev/fleet={FLEET}")
    return {s["metadata"]["name"]: s["metadata"]["uid"] for s in items["items"]}


def _nodes_of(fleet: Object) -> dict[int, list[str]]:
    return {s["index"]: s.get("nodes", []) for s in fleet.get("status", {}).get("shards", [])}


@pytest.mark.timeout(900)
def test_node_not_ready_then_deleted_replaces_its_shards_with_no_failed_or_mixed_request(
    operators: operators_module.Operators,
    local_cluster: cluster.LocalCluster,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    pod_runner: runner.Runner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    expected = {0: drill_module.greedy(drill_module.SOURCES[0])}
    namespace = kube_admin.create_namespace("c")
    steps = ("create", "not-ready", "scale-up", "deleted")
    drill = drill_module.Drill(kube_admin, kubeconfig, pod_runner, operators, namespace, {step: [] for step in steps})
    lost: str | None = None
    placed: dict[int, list[str]] = {}
    replaced_seconds = float("nan")
    started = time.monotonic()
    try:
        create = drill_module.simple_action(
            lambda: kube_admin.create(base.fleets(namespace), base.tiny_fleet(replicas=2, refit=base.DRAIN_IN_PLACE))
        )
        drill.step("create", create, lambda: drill.settled(2, 0), None)
        lost = _nodes_of(drill.fleet())[1][0]
        services = _services(kube_admin, namespace)
        with drill_module.Client(kubeconfig, namespace, expected) as client:
            drill.step(
                "not-ready",
                drill_module.simple_action(lambda: _not_ready(kube_admin, lost or "")),
                lambda: _tainted(kube_admin.get(f"/api/v1/nodes/{lost}")) and drill.settled(2, 0),
                client,
            )
            scale = drill_module.simple_action(
                lambda: kube_admin.patch(f"{drill.fleet_path}/scale", {"spec": {"replicas": 3}})
            )
            drill.step("scale-up", scale, lambda: drill.settled(3, 0), client)
            placed = _nodes_of(drill.fleet())
            on_lost = sorted(shard for shard, where in placed.items() if lost in where)
            pods_path = f"/api/v1/namespaces/{namespace}/pods"

            def delete_and_await_replacement() -> None:
                nonlocal replaced_seconds
                deleted = time.monotonic()
                kube_admin.delete(f"/api/v1/nodes/{lost}")
                kube_admin.wait_items(
                    pods_path,
                    lambda pods: _replaced(pods, on_lost, lost or ""),
                    timeout=POD_GC_QUARANTINE_SECONDS,
                    what=f"shards {on_lost} re-placed off the deleted node {lost}",
                )
                replaced_seconds = time.monotonic() - deleted

            drill.step(
                "deleted",
                drill_module.simple_action(delete_and_await_replacement),
                lambda: drill.settled(3, 0) and all(lost not in where for where in _nodes_of(drill.fleet()).values()),
                client,
            )
        with capsys.disabled():
            sys.stdout.write(
                f"\nnode drill: {lost} NotReady then deleted, its shards {on_lost} re-placed "
                f"{replaced_seconds:.1f} s after the deletion, drill {time.monotonic() - started:.0f} s\n"
            )
            sys.stdout.write("\n".join(drill_module.table(drill.reports)) + "\n")
        assert lost not in placed[2], "the new shard was placed on the NotReady node"
        assert 1 in on_lost
        fleet = drill.fleet()
        assert all(restarts >= 1 for shard, restarts in _restarts(fleet).items() if shard in on_lost)
        assert {name: uid for name, uid in _services(kube_admin, namespace).items() if name in services} == services
        assert replaced_seconds < POD_GC_QUARANTINE_SECONDS / 2, "re-placed no sooner than the pod GC would have"
        lost_events = kube_admin.list(f"/api/v1/namespaces/{namespace}/events", field_selector="reason=NodeLost")[
            "items"
        ]
        assert {
            shard
            for shard in on_lost
            if any(
                f"shard {shard} is re-placed" in e["message"] and f"node {lost} deleted" in e["message"]
                for e in lost_events
            )
        } == set(on_lost), lost_events
        assert sum(r.failed for r in drill.reports) == 0 and sum(r.mixed for r in drill.reports) == 0
        assert sum(r.served for r in drill.reports) > 0, "the client was served nothing"
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
        if lost is not None:
            _restore(kube_admin, local_cluster, lost)


def _replaced(pods: list[Object], shards: list[int], lost: str) -> bool:
    """Every pod of ``shards`` exists anew, bound to a node other than ``lost`` and running."""
    for shard in shards:
        found = [p for p in pods if p["metadata"]["name"] == f"{FLEET}-s{shard}-p0"]
        if not found or found[0]["metadata"].get("deletionTimestamp"):
            return False
        if found[0]["spec"].get("nodeName") in (None, lost) or found[0].get("status", {}).get("phase") != "Running":
            return False
    return True


def _restarts(fleet: Object) -> dict[int, int]:
    return {s["index"]: int(s.get("restarts", 0)) for s in fleet.get("status", {}).get("shards", [])}


def _restore(kube_admin: kube.Kube, local_cluster: cluster.LocalCluster, name: str) -> None:
    """Give the node back as the cluster created it, and wait until KWOK reports it Ready."""
    kube_admin.delete(f"/api/v1/nodes/{name}", missing_ok=True)
    kube_admin.wait(f"/api/v1/nodes/{name}", lambda n: n is None, timeout=60)
    manifest = next(
        m for m in nodes.node_manifests(local_cluster.pools, local_cluster.pod_network) if m["metadata"]["name"] == name
    )
    kube_admin.create("/api/v1/nodes", manifest)
    kube_admin.wait(
        f"/api/v1/nodes/{name}",
        lambda n: (kube.condition(n, "Ready") or {}).get("status") == "True" and not _tainted(n),
        timeout=120,
        what=f"node {name} Ready again",
    )


GPU_FLEET = "big-moe-tp16"
"""``examples/gb200-tp16.yaml``: two TP=16 shards of four 4-GPU GB200 trays, each inside one NVL72
clique (simulated nodes: KWOK runs the pods, no engine starts)."""


@pytest.mark.timeout(300)
def test_a_lost_tray_of_a_tp16_shard_is_replaced_whole_inside_one_clique(
    operators: operators_module.Operators, local_cluster: cluster.LocalCluster, kube_admin: kube.Kube
) -> None:
    """A GB200 tray under a TP=16 shard is deleted: the operator re-places that shard whole, four
    trays that share one clique label and exclude the lost one, behind the same Services, and the
    other shard is untouched."""
    operators.start()
    namespace = kube_admin.create_namespace("c")
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    lost: str | None = None
    try:
        manifest = yaml.safe_load((base.ROOT / "examples" / "gb200-tp16.yaml").read_text())
        kube_admin.create(base.fleets(namespace), manifest)
        first = kube_admin.wait_items(
            pods_path, lambda pods: _all_running(pods, 8), timeout=120, what="8 GB200 pods Running"
        )
        before = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in first}
        shard0 = sorted(name for name in before if name.startswith(f"{GPU_FLEET}-s0-"))
        lost = before[shard0[0]]
        services = _fleet_services(kube_admin, namespace, GPU_FLEET)

        kube_admin.delete(f"/api/v1/nodes/{lost}")
        after = kube_admin.wait_items(
            pods_path,
            lambda pods: _all_running(pods, 8) and lost not in {p["spec"]["nodeName"] for p in pods},
            timeout=POD_GC_QUARANTINE_SECONDS,
            what=f"shard 0 re-placed off the deleted tray {lost}",
        )

        now = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in after}
        assert {name: now[name] for name in now if "-s1-" in name} == {
            name: before[name] for name in before if "-s1-" in name
        }, "the other shard moved"
        cliques = {_clique(kube_admin, now[name]) for name in shard0}
        assert len(cliques) == 1 and len({now[name] for name in shard0}) == 4, (cliques, now)
        # The status follows the pods (their events are gathered before a reconcile writes it):
        # wait for shard 0's entry to list its new trays, then check its clique is theirs.
        trays = {now[name] for name in shard0}
        fleet = kube_admin.wait(
            f"{base.fleets(namespace)}/{GPU_FLEET}",
            lambda o: any(
                s["index"] == 0 and set(s.get("nodes", [])) == trays
                for s in (o or {}).get("status", {}).get("shards", [])
            ),
            timeout=60,
            what="shard 0's new trays in the status",
        )
        assert fleet is not None
        assert {s["index"]: s["clique"] for s in fleet["status"]["shards"]}[0] in cliques
        assert _fleet_services(kube_admin, namespace, GPU_FLEET) == services
        events = kube_admin.list(f"/api/v1/namespaces/{namespace}/events", field_selector="reason=NodeLost")["items"]
        assert any(f"node {lost} deleted" in e["message"] for e in events), events
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
        if lost is not None:
            _restore(kube_admin, local_cluster, lost)


def _all_running(pods: list[Object], count: int) -> bool:
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return len(live) == count and all(
        p["spec"].get("nodeName") and p.get("status", {}).get("phase") == "Running" for p in live
    )


def _fleet_services(kube_admin: kube.Kube, namespace: str, fleet: str) -> dict[str, str]:
    items = kube_admin.list(f"/api/v1/namespaces/{namespace}/services", label_selector=f"megafleet.dev/fleet={fleet}")
    return {s["metadata"]["name"]: s["metadata"]["uid"] for s in items["items"]}


def _clique(kube_admin: kube.Kube, node: str) -> str:
    found = kube_admin.get(f"/api/v1/nodes/{node}")
    assert found is not None, node
    return str(found["metadata"]["labels"][nodes.CLIQUE_LABEL])
