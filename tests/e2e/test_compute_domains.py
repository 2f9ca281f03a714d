"""DRA ComputeDomains end to end: a TP=16 shard on four GB200 trays of one clique gets a ComputeDomain
before its pods, each pod a ResourceClaim on the domain's channel that kube-scheduler allocates from
published ResourceSlices before it binds the pod, a new domain when the shard is re-placed after a
node loss, and none once the shard is gone.

Real here: the API server's ``resource.k8s.io/v1``, the ResourceClaim controller, the scheduler's
DRA allocation, and the operator. Stood in for (:mod:`megafleet_dev.dra` says why and how): the
ComputeDomain CRD, the driver controller's channel templates, and the kubelet plugin's
ResourceSlices; nothing prepares a claim on a node (KWOK runs no kubelet), which needs the hardware.

The CRD is installed for this module only and removed after it: the other tests' multi-node fleets
run on a cluster without the driver, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from megafleet.objects import Object
from megafleet_dev import cluster, dra, kube, nodes

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
FLEET = "big-moe-tp16"
WAIT = 120


@pytest.fixture(scope="module")
def driver(
    local_cluster: cluster.LocalCluster, kube_admin: kube.Kube, operator: Path
) -> Iterator[dra.ChannelTemplates]:
    kube_admin.install_crd(dra.crd())
    kube_admin.create(dra.DEVICE_CLASSES, dra.device_class())
    gb200 = kube_admin.list("/api/v1/nodes", label_selector=f"{nodes.PRODUCT_LABEL}=NVIDIA-GB200")["items"]
    for node in gb200:
        clique = node["metadata"]["labels"][nodes.CLIQUE_LABEL]
        for piece in dra.resource_slices([node["metadata"]["name"]], clique):
            kube_admin.create(dra.SLICES, piece)
    with local_cluster.kube() as client:
        templates = dra.ChannelTemplates(client)
        templates.start()
        try:
            yield templates
        finally:
            templates.stop()
            for piece in kube_admin.list(dra.SLICES)["items"]:
                if piece["metadata"].get("labels", {}).get(dra.SLICE_LABEL):
                    kube_admin.delete(f"{dra.SLICES}/{piece['metadata']['name']}", missing_ok=True)
            kube_admin.delete(f"{dra.DEVICE_CLASSES}/{dra.CHANNEL_CLASS}", missing_ok=True)
            crd = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/computedomains.{dra.GROUP}"
            kube_admin.delete(crd, missing_ok=True)
            kube_admin.wait(crd, lambda obj: obj is None, timeout=WAIT, what="the ComputeDomain CRD removed")


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def domains(client: kube.Kube, namespace: str) -> list[Object]:
    found = client.list(f"/apis/{dra.GROUP}/{dra.VERSION}/namespaces/{namespace}/computedomains")["items"]
    return [domain for domain in found if not domain["metadata"].get("deletionTimestamp")]


def engine_pods(client: kube.Kube, namespace: str) -> list[Object]:
    items = client.list(f"/api/v1/namespaces/{namespace}/pods")["items"]
    return [pod for pod in items if not pod["metadata"].get("deletionTimestamp")]


def bound(count: int) -> Callable[[list[Object]], bool]:
    """``count`` live pods of the fleet, every one bound to a node (so every claim was allocated)."""

    def check(items: list[Object]) -> bool:
        live = [pod for pod in items if not pod["metadata"].get("deletionTimestamp")]
        return len(live) == count and all(pod["spec"].get("nodeName") for pod in live)

    return check


def assert_claims_on(client: kube.Kube, namespace: str, domain: Object) -> set[str]:
    """Every pod claims ``domain``'s channel; its claim is allocated a channel on the pod's node and
    reserved for the pod. Returns the pods' nodes."""
    template = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
    placed = set()
    for pod in engine_pods(client, namespace):
        assert pod["spec"]["resourceClaims"] == [
            {"name": "compute-domain-channel", "resourceClaimTemplateName": template}
        ]
        assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "compute-domain-channel"}]
        (claim_status,) = pod["status"]["resourceClaimStatuses"]
        claim = client.get(
            f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{claim_status['resourceClaimName']}"
        )
        assert claim is not None
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        node = pod["spec"]["nodeName"]
        assert (result["driver"], result["pool"]) == (dra.DRIVER, node)
        assert result["device"].startswith("channel-")
        assert [ref["name"] for ref in claim["status"]["reservedFor"]] == [pod["metadata"]["name"]]
        placed.add(node)
    return placed


def node_clique(client: kube.Kube, name: str) -> str:
    node = client.get(f"/api/v1/nodes/{name}")
    assert node is not None
    return str(node["metadata"]["labels"][nodes.CLIQUE_LABEL])


def first_added(client: kube.Kube, collection: str, since: str) -> int:
    """The etcd revision at which the first object of ``collection`` was created after ``since``."""
    events = client.history(collection, since=since)
    return min(int(event["object"]["metadata"]["resourceVersion"]) for event in events if event["type"] == "ADDED")


def test_a_spanning_shard_runs_on_its_own_compute_domain(
    driver: dra.ChannelTemplates, kube_admin: kube.Kube, namespace: str
) -> None:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "gb200-tp16.yaml").read_text())
    manifest["spec"]["replicas"] = 1
    manifest["spec"]["placement"].pop("gang", None)
    since = kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["metadata"]["resourceVersion"]
    kube_admin.create(fleets(namespace), manifest)

    kube_admin.wait_items(f"/api/v1/namespaces/{namespace}/pods", bound(4), timeout=WAIT, what="4 pods bound")
    (domain,) = domains(kube_admin, namespace)
    fleet = kube_admin.get(f"{fleets(namespace)}/{FLEET}")
    assert fleet is not None
    assert domain["metadata"]["ownerReferences"][0]["uid"] == fleet["metadata"]["uid"]
    assert domain["spec"]["numNodes"] == 4
    # Made before the pods: nothing writes a domain here after its creation (the stand-in only reads
    # it), so its resourceVersion is the etcd revision it was created at, earlier than the first pod's.
    assert "status" not in domain
    assert int(domain["metadata"]["resourceVersion"]) < first_added(
        kube_admin, f"/api/v1/namespaces/{namespace}/pods", since
    )
    first_nodes = assert_claims_on(kube_admin, namespace, domain)
    assert len(first_nodes) == 4
    cliques = {node_clique(kube_admin, name) for name in first_nodes}
    assert len(cliques) == 1

    # A node is lost: the shard is placed again elsewhere in a clique, on a new domain.
    lost = sorted(first_nodes)[0]
    saved = kube_admin.get(f"/api/v1/nodes/{lost}")
    assert saved is not None
    kube_admin.delete(f"/api/v1/nodes/{lost}")
    try:

        def replaced(items: list[Object]) -> bool:
            live = [pod for pod in items if not pod["metadata"].get("deletionTimestamp")]
            on = {pod["spec"].get("nodeName") for pod in live}
            return bound(4)(items) and lost not in on

        kube_admin.wait_items(f"/api/v1/namespaces/{namespace}/pods", replaced, timeout=WAIT, what="shard re-placed")
        (second,) = domains(kube_admin, namespace)
        assert second["metadata"]["name"] != domain["metadata"]["name"]
        assert lost not in assert_claims_on(kube_admin, namespace, second)
    finally:
        restored = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {k: saved["metadata"][k] for k in ("name", "labels", "annotations")},
            "spec": {k: v for k, v in saved["spec"].items() if k in ("podCIDR", "podCIDRs", "taints")},
            "status": {k: saved["status"][k] for k in ("capacity", "allocatable", "addresses", "nodeInfo")},
        }
        kube_admin.create("/api/v1/nodes", restored)

    # The shard goes (scaled to zero): its domain goes with it.
    kube_admin.patch(f"{fleets(namespace)}/{FLEET}", {"spec": {"replicas": 0}})
    kube_admin.wait_items(
        f"/api/v1/namespaces/{namespace}/pods", lambda items: not items, timeout=WAIT, what="pods gone"
    )
    gone = kube_admin.wait_items(
        f"/apis/{dra.GROUP}/{dra.VERSION}/namespaces/{namespace}/computedomains",
        lambda items: not items,
        timeout=WAIT,
        what="the shard's ComputeDomain deleted",
    )
    assert gone == []
    assert driver.made  # the stand-in made each domain's channel template
