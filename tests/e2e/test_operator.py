"""The operator against the real local control plane: endpoints first, whole-shard placement by
clique, InvalidSpec, unschedulable fleets, scaling, deletion and idle reconciles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from megafleet.objects import Object
from megafleet_dev import kube, nodes

ROOT = Path(__file__).resolve().parents[2]
WAIT = 90


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def fleet(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "MegatronGeneration",
        "metadata": {"name": name},
        "spec": spec,
    }


def condition_is(kind: str, status: str) -> kube.Predicate:
    return lambda obj: (kube.condition(obj, kind) or {}).get("status") == status


def example(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / name).read_text())
    return document


def test_endpoints_are_published_before_the_first_pod_exists(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    manifest = example("tiny-cpu.yaml")
    created = kube_admin.create(fleets(namespace), manifest)
    # Every status change and every pod creation, in API-server order, from one watch each.
    path = f"{fleets(namespace)}/tiny"
    ready = kube_admin.wait(path, condition_is("Placed", "True"), timeout=WAIT, what="tiny placed")
    assert ready is not None

    since = created["metadata"]["resourceVersion"]
    pod_events = kube_admin.history(f"/api/v1/namespaces/{namespace}/pods", since=since)
    created_pods = [int(e["object"]["metadata"]["resourceVersion"]) for e in pod_events if e["type"] == "ADDED"]
    assert len(created_pods) == 2
    first_pod_rv = min(created_pods)
    history = [
        event
        for event in kube_admin.history(fleets(namespace), since=since)
        if event["object"]["metadata"]["name"] == "tiny"
    ]
    published = [
        int(event["object"]["metadata"]["resourceVersion"])
        for event in history
        if len(event["object"].get("status", {}).get("endpoints", [])) == 2
    ]
    assert published and min(published) < first_pod_rv
    status = ready["status"]
    assert [endpoint["shard"] for endpoint in status["endpoints"]] == [0, 1]
    assert [endpoint["service"] for endpoint in status["endpoints"]] == ["tiny-f0", "tiny-f0"]  # one ClusterIP
    service = kube_admin.get(f"/api/v1/namespaces/{namespace}/services/tiny-f0")
    assert service is not None
    assert [(port["name"], port["port"]) for port in service["spec"]["ports"]] == [("shard-0", 8000), ("shard-1", 8001)]
    for endpoint in status["endpoints"]:
        port = 8000 + endpoint["shard"]
        assert endpoint["url"] == f"http://{service['spec']['clusterIP']}:{port}/v1"
        assert endpoint["dnsURL"] == f"http://tiny-f0.{namespace}.svc:{port}/v1"
    configmap = kube_admin.get(f"/api/v1/namespaces/{namespace}/configmaps/tiny-endpoints")
    assert configmap is not None
    assert configmap["data"]["urls"].split() == [endpoint["url"] for endpoint in status["endpoints"]]
    assert status["selector"] == "megafleet.dev/fleet=tiny,megafleet.dev/component=engine"


def test_tp16_shards_each_sit_whole_inside_one_clique(operator: Path, kube_admin: kube.Kube, namespace: str) -> None:
    manifest = example("gb200-tp16.yaml")
    kube_admin.create(fleets(namespace), manifest)

    placed = kube_admin.wait(f"{fleets(namespace)}/big-moe-tp16", condition_is("Placed", "True"), timeout=WAIT)

    assert placed is not None
    shards = placed["status"]["shards"]
    assert len(shards) == 2
    seen_nodes: set[str] = set()
    for shard in shards:
        assert len(shard["pods"]) == 4
        pods = [
            kube_admin.wait(
                f"/api/v1/namespaces/{namespace}/pods/{name}",
                lambda p: bool(p and p["spec"].get("nodeName")),
                timeout=WAIT,
            )
            for name in shard["pods"]
        ]
        cliques = set()
        for pod in pods:
            assert pod is not None
            node = kube_admin.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
            assert node is not None
            cliques.add(node["metadata"]["labels"][nodes.CLIQUE_LABEL])
            assert pod["spec"]["nodeName"] not in seen_nodes
            seen_nodes.add(pod["spec"]["nodeName"])
        assert cliques == {shard["clique"]}
    assert shards[0]["clique"] != shards[1]["clique"]  # spreadShards: true


def test_a_fleet_that_does_not_fit_reports_why(operator: Path, kube_admin: kube.Kube, namespace: str) -> None:
    manifest = example("gb200-tp16.yaml")
    manifest["metadata"]["name"] = "too-big"
    manifest["spec"]["parallelism"] = {"tensor": 16, "pipeline": 8, "expert": 16}  # 128 GPUs > a 72-GPU clique
    kube_admin.create(fleets(namespace), manifest)

    status = kube_admin.wait(f"{fleets(namespace)}/too-big", condition_is("Placed", "False"), timeout=WAIT)

    assert status is not None
    placed = kube.condition(status, "Placed")
    assert placed is not None and placed["reason"] == "Unschedulable"
    assert "clique" in placed["message"]
    assert all(shard["phase"] == "Pending" and shard["lastError"] for shard in status["status"]["shards"])
    assert kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"] == []


def test_missing_api_key_secret_is_invalid_spec_and_nothing_is_created(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    manifest = example("tiny-cpu.yaml")
    manifest["spec"]["frontend"] = {"apiKeySecret": {"name": "frontend-key"}}
    kube_admin.create(fleets(namespace), manifest)

    invalid = kube_admin.wait(f"{fleets(namespace)}/tiny", condition_is("InvalidSpec", "True"), timeout=WAIT)

    assert invalid is not None
    message = (kube.condition(invalid, "InvalidSpec") or {})["message"]
    assert "spec.frontend.apiKeySecret" in message and "frontend-key" in message
    assert kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"] == []
    assert kube_admin.list(f"/api/v1/namespaces/{namespace}/services")["items"] == []
    events = kube_admin.wait_items(
        f"/api/v1/namespaces/{namespace}/events", bool, field_selector="reason=InvalidSpec", timeout=WAIT
    )
    assert events[0]["type"] == "Warning" and "frontend-key" in events[0]["message"]

    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "frontend-key"},
        "stringData": {"api-key": "k"},
    }
    kube_admin.create(f"/api/v1/namespaces/{namespace}/secrets", secret)

    kube_admin.wait(f"{fleets(namespace)}/tiny", condition_is("Placed", "True"), timeout=WAIT, what="fleet recovers")


def frontend_url(kube_admin: kube.Kube, namespace: str, pod: str) -> str:
    """Where a test reaches a frontend: its pod's 127.x IP (ClusterIPs are data, never targets)."""
    found = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
    assert found is not None
    return f"http://{found['status']['podIP']}:8000/v1"


def test_tiny_fleet_serves_chat_completions_through_its_frontends(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    import openai

    kube_admin.create(fleets(namespace), example("tiny-cpu.yaml"))

    ready = kube_admin.wait(f"{fleets(namespace)}/tiny", condition_is("Ready", "True"), timeout=WAIT, what="Ready")

    assert ready is not None
    assert ready["status"]["readyReplicas"] == 2 and ready["status"]["weightVersion"] == 0
    assert (kube.condition(ready, "EndpointsVerified") or {}).get("status") == "True"
    assert [shard["phase"] for shard in ready["status"]["shards"]] == ["Ready", "Ready"]
    answers = []
    for shard in ready["status"]["shards"]:
        with openai.OpenAI(base_url=frontend_url(kube_admin, namespace, shard["pods"][0]), api_key="unused") as client:
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
            )
        answers.append(reply.choices[0].message.content)
    assert answers[0] and answers[0] == answers[1]  # same weights, greedy: every frontend agrees


def test_a_deleted_pod_comes_back_behind_the_same_endpoint(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    kube_admin.create(fleets(namespace), example("tiny-cpu.yaml"))
    path = f"{fleets(namespace)}/tiny"
    before = kube_admin.wait(path, condition_is("Ready", "True"), timeout=WAIT)
    assert before is not None
    old = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/tiny-s1-p0")
    assert old is not None

    kube_admin.delete(f"/api/v1/namespaces/{namespace}/pods/tiny-s1-p0")

    def healed(obj: Object | None) -> bool:
        shard = (obj or {}).get("status", {}).get("shards", [{}, {}])[1]
        return bool(shard.get("restarts") == 1 and shard.get("phase") == "Ready")

    after = kube_admin.wait(path, healed, timeout=WAIT, what="shard 1 re-placed and Ready")
    assert after is not None
    assert after["status"]["endpoints"] == before["status"]["endpoints"]
    new = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/tiny-s1-p0")
    assert new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]


def test_kubectl_scale_adds_and_removes_shards(operator: Path, kube_admin: kube.Kube, namespace: str) -> None:
    manifest = example("tiny-cpu.yaml")
    manifest["spec"]["replicas"] = 1
    kube_admin.create(fleets(namespace), manifest)
    path = f"{fleets(namespace)}/tiny"
    kube_admin.wait(path, condition_is("Ready", "True"), timeout=WAIT)

    kube_admin.patch(f"{path}/scale", {"spec": {"replicas": 3}})
    grown = kube_admin.wait(
        path, lambda o: (o or {}).get("status", {}).get("readyReplicas") == 3, timeout=WAIT, what="3 shards"
    )
    assert grown is not None and len(grown["status"]["endpoints"]) == 3

    kube_admin.patch(f"{path}/scale", {"spec": {"replicas": 1}})
    shrunk = kube_admin.wait(
        path,
        lambda o: len((o or {}).get("status", {}).get("shards", [])) == 1 and condition_is("Ready", "True")(o),
        timeout=WAIT,
        what="back to 1 shard",
    )
    assert shrunk is not None and len(shrunk["status"]["endpoints"]) == 1
    kube_admin.wait_items(
        f"/api/v1/namespaces/{namespace}/pods",
        lambda items: len(items) == 1,
        timeout=WAIT,
        what="pods of removed shards",
    )
    assert kube_admin.get(f"/api/v1/namespaces/{namespace}/services/tiny-s2") is None


def test_fleets_created_together_never_share_gpus(operator: Path, kube_admin: kube.Kube, namespace: str) -> None:
    spec = {
        "model": {"source": "/m"},
        "parallelism": {"tensor": 8},
        "resources": {"gpusPerNode": 8},
        "placement": {"nodeSelector": {nodes.POOL_LABEL: "h200"}},
    }
    for index in range(4):  # the h200 pool has exactly four 8-GPU nodes
        kube_admin.create(fleets(namespace), fleet(f"f{index}", spec))

    def all_running(items: list[Object]) -> bool:
        return len(items) == 4 and all(p["status"].get("phase") == "Running" for p in items)

    pods = kube_admin.wait_items(f"/api/v1/namespaces/{namespace}/pods", all_running, timeout=WAIT, what="4 pods")

    assert len({pod["spec"]["nodeName"] for pod in pods}) == 4


def test_deleting_a_fleet_removes_everything_it_created(operator: Path, kube_admin: kube.Kube, namespace: str) -> None:
    manifest = example("tiny-cpu.yaml")
    kube_admin.create(fleets(namespace), manifest)
    kube_admin.wait(f"{fleets(namespace)}/tiny", condition_is("Placed", "True"), timeout=WAIT)

    kube_admin.delete(f"{fleets(namespace)}/tiny")

    for kind in ("pods", "services", "configmaps", "secrets"):
        kube_admin.wait_items(
            f"/api/v1/namespaces/{namespace}/{kind}",
            lambda items: not [i for i in items if i["metadata"].get("labels", {}).get("megafleet.dev/fleet")],
            timeout=WAIT,
            what=f"{kind} of the deleted fleet",
        )


def test_frontends_require_the_api_key_from_the_fleets_secret(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    import openai

    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys"}, "stringData": {"api-key": "s3cret"}}
    kube_admin.create(f"/api/v1/namespaces/{namespace}/secrets", secret)
    manifest = example("tiny-cpu.yaml")
    manifest["spec"]["replicas"] = 1
    manifest["spec"]["frontend"] = {"apiKeySecret": {"name": "keys"}}
    kube_admin.create(fleets(namespace), manifest)
    kube_admin.wait(f"{fleets(namespace)}/tiny", condition_is("Ready", "True"), timeout=WAIT)
    url = frontend_url(kube_admin, namespace, "tiny-s0-p0")

    with openai.OpenAI(base_url=url, api_key="wrong") as client, pytest.raises(openai.AuthenticationError):
        client.models.list()
    with openai.OpenAI(base_url=url, api_key="s3cret") as client:
        assert [model.id for model in client.models.list()] == ["tiny"]
