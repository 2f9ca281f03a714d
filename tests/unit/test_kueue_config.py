"""The Kueue tier's configuration (megafleet_dev.kueue): Kueue's settings, its webhooks trimmed to
pods and its own objects and called through the ExternalName Service, and that Kueue is built apart
from the control plane."""

from __future__ import annotations

from pathlib import Path

import yaml

from megafleet_dev import kueue, toolchain

MANIFESTS = yaml.safe_dump_all(
    [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "mutating-webhook-configuration"},
            "webhooks": [
                {"name": f"m{name}.kb.io", "clientConfig": {"service": {"name": "webhook-service", "path": path}}}
                for name, path in (
                    ("job", "/mutate-batch-v1-job"),
                    ("pod", "/mutate--v1-pod"),
                    ("workload", "/mutate-kueue-x-k8s-io-v1beta2-workload"),
                )
            ],
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "validating-webhook-configuration"},
            "webhooks": [
                {
                    "name": "vpod.kb.io",
                    "clientConfig": {"service": {"name": "webhook-service", "path": "/validate--v1-pod"}},
                }
            ],
        },
    ]
)


def test_the_webhooks_kept_are_pods_and_kueues_objects_through_the_service_and_only_queued_pods() -> None:
    mutating, validating = kueue.webhook_configurations(MANIFESTS, 9443)
    assert mutating["metadata"] == {"name": "kueue-mutating-webhook-configuration"}
    assert validating["metadata"] == {"name": "kueue-validating-webhook-configuration"}
    assert [w["name"] for w in mutating["webhooks"]] == ["mpod.kb.io", "mworkload.kb.io"]
    pod = mutating["webhooks"][0]
    assert pod["clientConfig"] == {
        "service": {
            "namespace": "kueue-system",
            "name": "kueue-webhook-service",
            "path": "/mutate--v1-pod",
            "port": 9443,
        }
    }
    assert pod["objectSelector"] == {"matchExpressions": [{"key": "kueue.x-k8s.io/queue-name", "operator": "Exists"}]}
    assert "objectSelector" not in mutating["webhooks"][1]
    assert validating["webhooks"][0]["objectSelector"] == pod["objectSelector"]


def test_kueue_runs_the_pod_integration_alone_without_leader_election_on_loopback(tmp_path: Path) -> None:
    config = kueue.configuration(tmp_path, webhook_port=1, probe_port=2, metrics_port=3)
    assert config["integrations"] == {"frameworks": ["pod"]}
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["webhook"] == {"port": 1, "host": "127.0.0.1", "certDir": str(tmp_path / "certs")}
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:2"
    assert config["metrics"]["bindAddress"] == "127.0.0.1:3"
    assert config["internalCertManagement"]["webhookServiceName"] == kueue.WEBHOOK_SERVICE
    assert kueue.conversion(1)["webhook"]["clientConfig"]["service"]["name"] == kueue.WEBHOOK_SERVICE


def test_kueue_is_built_only_when_asked_for() -> None:
    assert "kueue" not in toolchain.CONTROL_PLANE and "kueue" not in toolchain.AUTOSCALE
    assert toolchain.KUEUE == ("kueue",)
    assert toolchain.program_path("kueue").parent == toolchain.program_path("kueue-crds.yaml").parent
