"""``spec.pod`` and its siblings (``engine.envFrom``, env ``valueFrom``) on the real local control
plane: the operator's pods carry the user's volumes, mounts, /dev/shm, caches, service account,
priority class, pull secrets, labels and annotations; the API server accepts them; a change of the
template rolls the running fleet; a ServiceAccount or PriorityClass that does not exist is InvalidSpec
(until it exists), not pods the API server refuses."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import yaml

from megafleet.objects import Object
from megafleet_dev import kube

ROOT = Path(__file__).resolve().parents[2]
WAIT = 120


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def ready(obj: Object | None) -> bool:
    return (kube.condition(obj or {}, "Ready") or {}).get("status") == "True"


def tiny(pod: dict[str, Any]) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"]["replicas"] = 1
    manifest["spec"]["pod"] = pod
    manifest["spec"]["engine"]["env"] = [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ]
    manifest["spec"]["engine"]["envFrom"] = [{"configMapRef": {"name": "tuning"}, "prefix": "TUNED_"}]
    return manifest


def test_the_pods_carry_the_users_template_and_a_change_rolls_them(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    priority = f"rl-{uuid.uuid4().hex[:8]}"
    kube_admin.create(
        "/apis/scheduling.k8s.io/v1/priorityclasses",
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": priority}, "value": 1000},
    )
    core = f"/api/v1/namespaces/{namespace}"
    kube_admin.create(f"{core}/serviceaccounts", {"metadata": {"name": "engines"}})
    kube_admin.create(f"{core}/secrets", {"metadata": {"name": "hf"}, "stringData": {"token": "t"}})
    kube_admin.create(f"{core}/configmaps", {"metadata": {"name": "tuning"}, "data": {"NCCL_ALGO": "Ring"}})
    pod = {
        "labels": {"team": "rl", "megafleet.dev/fleet": "spoofed"},
        "annotations": {"example.com/owner": "alice"},
        "serviceAccountName": "engines",
        "priorityClassName": priority,
        "imagePullSecrets": [{"name": "registry"}],
        "volumes": [
            {"name": "settings", "configMap": {"name": "tuning"}},
            {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
        "volumeMounts": [
            {"name": "settings", "mountPath": "/etc/engine", "readOnly": True},
            {"name": "scratch", "mountPath": "/scratch"},
        ],
        "shmSize": "256Mi",
        "cache": {"sizeLimit": "2Gi"},
    }
    path = f"{fleets(namespace)}/tiny"
    try:
        kube_admin.create(fleets(namespace), tiny(pod))
        kube_admin.wait(path, ready, timeout=WAIT, what="tiny Ready")

        first = kube_admin.get(f"{core}/pods/tiny-s0-p0")
        assert first is not None
        metadata, spec = first["metadata"], first["spec"]
        container = spec["containers"][0]
        assert metadata["labels"]["team"] == "rl" and metadata["labels"]["megafleet.dev/fleet"] == "tiny"
        assert metadata["annotations"]["example.com/owner"] == "alice"
        assert spec["serviceAccountName"] == "engines" and spec["automountServiceAccountToken"] is False
        assert spec["priorityClassName"] == priority and spec["priority"] == 1000  # resolved by the API server
        assert spec["imagePullSecrets"] == [{"name": "registry"}]
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        assert volumes["settings"]["configMap"]["name"] == "tuning"
        assert volumes["megafleet-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "256Mi"}
        assert volumes["megafleet-cache"]["emptyDir"] == {"sizeLimit": "2Gi"}
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        assert mounts["/etc/engine"] == "settings" and mounts["/scratch"] == "scratch"
        assert mounts["/dev/shm"] == "megafleet-shm" and mounts["/var/cache/megafleet"] == "megafleet-cache"
        assert container["envFrom"] == [{"configMapRef": {"name": "tuning"}, "prefix": "TUNED_"}]
        env = {item["name"]: item for item in container["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        assert env["HF_HOME"]["value"] == "/var/cache/megafleet/huggingface"

        # A template change (one more label) rolls the shard: a new pod with it, Ready again.
        kube_admin.patch(path, {"spec": {"pod": {"labels": {"team": "rl", "stage": "two"}}}})

        def rolled(obj: Object | None) -> bool:
            current = kube_admin.get(f"{core}/pods/tiny-s0-p0")
            return bool(
                ready(obj)
                and current is not None
                and current["metadata"]["uid"] != metadata["uid"]
                and (current["metadata"].get("labels") or {}).get("stage") == "two"
            )

        kube_admin.wait(path, rolled, timeout=WAIT, what="the shard rolled to the new template")
        second = kube_admin.get(f"{core}/pods/tiny-s0-p0")
        assert second is not None
        assert (
            second["metadata"]["annotations"]["megafleet.dev/template-hash"]
            != (metadata["annotations"]["megafleet.dev/template-hash"])
        )
    finally:
        kube_admin.delete(f"/apis/scheduling.k8s.io/v1/priorityclasses/{priority}", missing_ok=True)


def test_a_missing_service_account_or_priority_class_is_invalid_spec_until_it_exists(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    priority = f"rl-{uuid.uuid4().hex[:8]}"
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"]["pod"] = {"serviceAccountName": "nobody", "priorityClassName": priority}
    kube_admin.create(fleets(namespace), manifest)
    path = f"{fleets(namespace)}/tiny"

    def invalid_naming(text: str) -> kube.Predicate:
        def check(obj: Object | None) -> bool:
            condition = kube.condition(obj or {}, "InvalidSpec") or {}
            return condition.get("status") == "True" and text in condition.get("message", "")

        return check

    try:
        kube_admin.wait(path, invalid_naming("spec.pod.serviceAccountName"), timeout=WAIT, what="no ServiceAccount")
        assert kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"] == []

        kube_admin.create(f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "nobody"}})
        invalid = kube_admin.wait(path, invalid_naming("spec.pod.priorityClassName"), timeout=WAIT, what="no class")
        assert invalid is not None and priority in (kube.condition(invalid, "InvalidSpec") or {})["message"]
        assert kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"] == []

        kube_admin.create(
            "/apis/scheduling.k8s.io/v1/priorityclasses",
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": priority}, "value": 7},
        )
        placed = kube_admin.wait(
            path,
            lambda obj: (kube.condition(obj or {}, "Placed") or {}).get("status") == "True",
            timeout=WAIT,
            what="the fleet placed once both exist",
        )
        assert placed is not None
        assert (kube.condition(placed, "InvalidSpec") or {}).get("status") != "True"
    finally:
        kube_admin.delete(f"/apis/scheduling.k8s.io/v1/priorityclasses/{priority}", missing_ok=True)


def test_every_volume_source_and_field_yields_a_pod_the_api_server_accepts(
    kube_admin: kube.Kube, namespace: str
) -> None:
    """The typed subset of the core API serializes to what the API server validates (server-side dry run)."""
    from megafleet import desired, planner
    from megafleet.api import v1alpha1

    suffix = uuid.uuid4().hex[:8]
    raw = yaml.safe_load((ROOT / "examples" / "llama-8b-model-volume.yaml").read_text())["spec"]
    raw["pod"]["runtimeClassName"] = f"nvidia-{suffix}"
    raw["pod"]["priorityClassName"] = f"rl-{suffix}"
    kube_admin.create(f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "rl-engines"}})
    classes: list[tuple[str, dict[str, Any]]] = [
        ("/apis/node.k8s.io/v1/runtimeclasses", {"metadata": {"name": f"nvidia-{suffix}"}, "handler": "nvidia"}),
        ("/apis/scheduling.k8s.io/v1/priorityclasses", {"metadata": {"name": f"rl-{suffix}"}, "value": 10}),
    ]
    raw["pod"]["volumes"] += [
        {"name": "host", "hostPath": {"path": "/data", "type": "DirectoryOrCreate"}},
        {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        {"name": "settings", "configMap": {"name": "settings", "defaultMode": 0o444, "optional": True}},
        {"name": "keys", "secret": {"secretName": "keys", "defaultMode": 0o400}},
        {"name": "blob", "csi": {"driver": "blob.csi.azure.com", "readOnly": True, "volumeAttributes": {"a": "b"}}},
        {"name": "weights", "image": {"reference": "registry.example.com/models/llama:8b", "pullPolicy": "Always"}},
        {"name": "share", "nfs": {"server": "10.0.0.2", "path": "/exports/models", "readOnly": True}},
    ]
    raw["pod"]["volumeMounts"] += [
        {"name": volume["name"], "mountPath": f"/mnt/{volume['name']}", "subPath": "x"}
        for volume in raw["pod"]["volumes"][2:]
    ]
    raw["engine"]["env"].append({"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    parsed = desired.ParsedFleet("llama", namespace, "uid-1", 1, v1alpha1.MegatronGenerationSpec.model_validate(raw))
    placement = planner.ShardPlacement(clique=None, pods=(planner.PodPlacement("gpu-node", 8),))
    pod = desired.shard_pods(parsed, 0, placement)[0]
    pod["metadata"].pop("ownerReferences")  # the fleet does not exist here

    for collection, body in classes:
        kube_admin.create(collection, body)
    try:
        accepted = kube_admin.create(f"/api/v1/namespaces/{namespace}/pods?dryRun=All", pod)
    finally:
        for collection, body in classes:
            kube_admin.delete(f"{collection}/{body['metadata']['name']}", missing_ok=True)

    volumes = {volume["name"]: volume for volume in accepted["spec"]["volumes"]}
    assert set(volumes) >= {"models", "kernel-cache", "host", "scratch", "settings", "keys", "blob", "weights", "share"}
    assert volumes["weights"]["image"]["reference"] == "registry.example.com/models/llama:8b"
    assert accepted["spec"]["containers"][0]["resources"]["limits"]["rdma/ib"] == "1"
    assert accepted["spec"]["priority"] == 10 and accepted["spec"]["runtimeClassName"] == f"nvidia-{suffix}"
