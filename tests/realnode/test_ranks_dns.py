"""A two-pod shard's ranks find each other through the headless Service's DNS names on the real node.

The operator runs a CPU shard as one rank (the planner refuses more), so this test takes the
operator's own objects for a two-pod shard (``desired.ranks_service`` and ``desired.shard_pods`` of a
1-GPU-per-node, tensor-2 fleet: hostname, subdomain, rank and master variables, security context)
and changes only what a CPU node cannot run: no GPU request, no owner (there is no fleet object),
and the container runs a gloo group instead of the engine. Rank 0 broadcasts a weight tensor, as a
refit's collective does; both ranks report what they received and which address the master's DNS
name (``<pod>.<ranks service>.<namespace>.svc``) resolved to.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from megafleet import desired, planner
from megafleet.api import v1alpha1
from megafleet_dev import kube, realnode
from megafleet_protocol import env

pytestmark = [pytest.mark.realnode, pytest.mark.e2e, pytest.mark.timeout(1800)]

WAIT = 240

GLOO = f"""
import datetime, hashlib, json, os, socket
import torch, torch.distributed as dist
rank, world = int(os.environ["{env.RANK}"]), int(os.environ["{env.WORLD_SIZE}"])
master, port = os.environ["{env.MASTER_ADDR}"], int(os.environ["{env.MASTER_PORT}"])
master_ip = socket.gethostbyname(master)
dist.init_process_group(
    "gloo", init_method=f"tcp://{{master}}:{{port}}", rank=rank, world_size=world,
    timeout=datetime.timedelta(seconds=180),
)
weights = torch.randn(4096, generator=torch.Generator().manual_seed(7)) if rank == 0 else torch.zeros(4096)
dist.broadcast(weights, src=0)
dist.barrier()
dist.destroy_process_group()
report = {{"rank": rank, "master": master, "master_ip": master_ip,
          "digest": hashlib.sha256(weights.numpy().tobytes()).hexdigest()}}
open("/dev/termination-log", "w").write(json.dumps(report))
"""


def two_pod_shard(namespace: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The operator's headless Service and pods of shard 0 of a two-pod shard, run as gloo ranks."""
    spec = v1alpha1.MegatronGenerationSpec.model_validate(
        {
            "model": {"source": "tiny://llama"},
            "replicas": 1,
            "parallelism": {"tensor": 2},
            "resources": {"gpusPerNode": 1, "cpu": "250m", "memory": "1Gi"},
            "placement": {"nodeSelector": {realnode.REAL_NODE_LABEL: "true"}},
        }
    )
    fleet = desired.ParsedFleet(name="ranks", namespace=namespace, uid="none", generation=1, spec=spec)
    assert fleet.layout.pods_per_shard == 2
    placement = planner.ShardPlacement(
        clique=None, pods=(planner.PodPlacement(realnode.NODE_NAME, 1), planner.PodPlacement(realnode.NODE_NAME, 1))
    )
    service = desired.ranks_service(fleet)
    pods = desired.shard_pods(fleet, 0, placement)
    for obj in (service, *pods):
        del obj["metadata"]["ownerReferences"]  # no fleet object: the garbage collector would delete them
    for pod in pods:
        pod["spec"]["restartPolicy"] = "Never"
        container = pod["spec"]["containers"][0]
        gpu = spec.resources.gpu_resource
        assert container["resources"]["limits"][gpu] == "1"
        container["resources"] = {
            k: {r: v for r, v in d.items() if r != gpu} for k, d in container["resources"].items()
        }
        container.pop("readinessProbe", None)  # the engine's; the ranks serve no HTTP
        container["command"], container["args"] = ["python", "-c", GLOO], []
        pod["spec"]["volumes"] = [v for v in pod["spec"]["volumes"] if v["name"] != "agent-token"]
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "agent-token"]
    return service, pods


def test_two_ranks_reach_each_other_through_the_headless_service_dns_names(
    kube_admin: kube.Kube, real_node: realnode.RealNode
) -> None:
    namespace = kube_admin.create_namespace("t")
    kube_admin.patch(
        f"/api/v1/namespaces/{namespace}",
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
    )
    try:
        service, pods = two_pod_shard(namespace)
        assert service["spec"]["clusterIP"] == "None"
        kube_admin.create(f"/api/v1/namespaces/{namespace}/services", service)
        for pod in pods:
            kube_admin.create(f"/api/v1/namespaces/{namespace}/pods", pod)
        reports, ips = [], []
        for pod in pods:
            done = kube_admin.wait(
                f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}",
                lambda obj: (obj or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"),
                timeout=WAIT,
                what=f"rank pod {pod['metadata']['name']} to finish",
            )
            assert done is not None
            state = done["status"]["containerStatuses"][0]["state"]["terminated"]
            assert done["status"]["phase"] == "Succeeded", state
            assert done["spec"]["nodeName"] == realnode.NODE_NAME
            reports.append(json.loads(state["message"]))
            ips.append(done["status"]["podIP"])
        master = f"{pods[0]['metadata']['name']}.{service['metadata']['name']}.{namespace}.svc"
        assert [report["rank"] for report in reports] == [0, 1]
        assert {report["master"] for report in reports} == {master}
        assert {report["master_ip"] for report in reports} == {ips[0]}  # pod 0's address, by DNS
        assert reports[0]["digest"] == reports[1]["digest"]  # rank 1 holds rank 0's weights
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
