"""Kueue beside the local control plane: the real admission layer that meters a fleet's shards.

Used by ``megafleet dev up --kueue`` (:mod:`megafleet_dev.cli`) and the Kueue tier's tests
(``tests/e2e/test_kueue.py``). :func:`start` builds Kueue on first use
(:data:`megafleet_dev.toolchain.KUEUE`, never with the rest of the control plane) and starts its
controller manager as a process of the :class:`~megafleet_dev.cluster.LocalCluster` (so
``megafleet dev down`` stops it too), with only the ``pod`` integration on: the operator's pods
carry Kueue's pod-group labels (docs/kueue.md says why that object).

Kueue's webhooks (the pod webhook gates a queued pod; its own objects are defaulted and validated)
are served by the manager on 127.0.0.1. The API server reaches them the way it reaches KEDA's
metrics server (:mod:`megafleet_dev.autoscale`): an ``ExternalName`` Service naming 127.0.0.1, since
ClusterIPs lead nowhere here. Kueue's own certificate management is left on: it writes a CA and a
serving certificate for ``kueue-webhook-service.kueue-system.svc`` (the name the API server checks
through that Service) into a Secret, which :func:`start` copies into Kueue's certificate folder as a
kubelet would mount it, and injects the CA into the webhook configurations and the CRDs' conversion
webhooks. Turned off, Kueue reads its metrics certificate from a fixed ``/etc`` path instead.

The webhook configurations are Kueue's own, trimmed to the pod webhooks and Kueue's objects; the pod
webhooks select only pods that name a queue (``kueue.x-k8s.io/queue-name``), so every other pod of
the cluster is created as if Kueue were not there. Kueue's visibility API server is off.

Invariant: every listener is on 127.0.0.1 on a free port.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import yaml

from megafleet_dev import cluster, kube, toolchain

NAMESPACE = "kueue-system"
WEBHOOK_SERVICE = "kueue-webhook-service"
WEBHOOK_SECRET = "kueue-webhook-server-cert"
MUTATING = "kueue-mutating-webhook-configuration"
VALIDATING = "kueue-validating-webhook-configuration"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
API = "/apis/kueue.x-k8s.io/v1beta2"

CONVERTED_CRDS = (
    "clusterqueues.kueue.x-k8s.io",
    "cohorts.kueue.x-k8s.io",
    "localqueues.kueue.x-k8s.io",
    "multikueueclusters.kueue.x-k8s.io",
    "workloads.kueue.x-k8s.io",
)
"""The CRDs Kueue's certificate manager injects its CA into, as their conversion webhook's: it fails
on a CRD without one, so they get the conversion webhook Kueue's kustomization gives them."""

_UNMANAGED_NAMESPACES = {
    "matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", NAMESPACE]}
    ]
}


@dataclasses.dataclass(frozen=True)
class Kueue:
    """What :func:`start` started: the manager's process and its webhook port."""

    webhook_port: int
    records: tuple[cluster.ProcessRecord, ...]


def configuration(folder: Path, *, webhook_port: int, probe_port: int, metrics_port: int) -> dict[str, Any]:
    """Kueue's ``Configuration``: the pod integration only, no leader election, listeners on 127.0.0.1."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{probe_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(folder / "certs")},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": WEBHOOK_SERVICE,
            "webhookSecretName": WEBHOOK_SECRET,
        },
        "managedJobsNamespaceSelector": _UNMANAGED_NAMESPACES,
        "integrations": {"frameworks": ["pod"]},
    }


def webhook_configurations(manifests: str, port: int) -> list[dict[str, Any]]:
    """Kueue's two webhook configurations, named as its certificate manager expects, keeping the
    webhooks of pods and of Kueue's own objects, each calling ``kueue-webhook-service`` on ``port``."""
    found = []
    for document in yaml.safe_load_all(manifests):
        if not document:
            continue
        configured = copy.deepcopy(document)
        mutating = configured["kind"] == "MutatingWebhookConfiguration"
        configured["metadata"] = {"name": MUTATING if mutating else VALIDATING}
        kept = []
        for webhook in configured["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            if not (path.endswith("--v1-pod") or "-kueue-x-k8s-io-" in path):
                continue
            webhook["clientConfig"] = {
                "service": {"namespace": NAMESPACE, "name": WEBHOOK_SERVICE, "path": path, "port": port}
            }
            if path.endswith("--v1-pod"):
                webhook["namespaceSelector"] = _UNMANAGED_NAMESPACES
                webhook["objectSelector"] = {"matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]}
            kept.append(webhook)
        configured["webhooks"] = kept
        found.append(configured)
    return found


def conversion(port: int) -> dict[str, Any]:
    """The conversion webhook Kueue's kustomization gives its versioned CRDs."""
    service = {"namespace": NAMESPACE, "name": WEBHOOK_SERVICE, "path": "/convert", "port": port}
    return {
        "strategy": "Webhook",
        "webhook": {"clientConfig": {"service": service}, "conversionReviewVersions": ["v1"]},
    }


def start(local: cluster.LocalCluster) -> Kueue:
    """Build (once) and start Kueue for ``local``; returns once its webhooks answer."""
    toolchain.ensure_built(toolchain.KUEUE, report=local.report)
    folder = local.state_dir / "kueue"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "certs").mkdir(exist_ok=True)
    webhook_port, probe_port, metrics_port = cluster.free_port(), cluster.free_port(), cluster.free_port()
    settings = configuration(folder, webhook_port=webhook_port, probe_port=probe_port, metrics_port=metrics_port)
    config_file = folder / "configuration.yaml"
    config_file.write_text(yaml.safe_dump(settings, sort_keys=False))
    with local.kube() as client:
        _install(client, webhook_port)
    env = dict(os.environ, KUBECONFIG=str(local.kubeconfig))
    record = local.spawn(
        "kueue",
        [
            str(toolchain.program_path("kueue")),
            f"--config={config_file}",
            "--feature-gates=VisibilityOnDemand=false",
            "--zap-log-level=info",
        ],
        env=env,
    )
    try:
        with local.kube() as client:
            local.wait_for("kueue", functools.partial(_mount_certificate, client, folder / "certs"))
            local.wait_for("kueue", functools.partial(cluster.http_not_ok, f"http://127.0.0.1:{probe_port}/readyz"))
            local.wait_for("kueue", functools.partial(_webhooks_not_serving, client))
    except BaseException:
        local.stop_processes([record])
        raise
    return Kueue(webhook_port=webhook_port, records=(record,))


def stop(local: cluster.LocalCluster, running: Kueue) -> None:
    """Remove the webhook configurations (the API server would keep calling them) and stop Kueue."""
    with local.kube() as client:
        for kind, name in (("mutating", MUTATING), ("validating", VALIDATING)):
            client.delete(f"/apis/admissionregistration.k8s.io/v1/{kind}webhookconfigurations/{name}", missing_ok=True)
    local.stop_processes(list(running.records))


def _install(client: kube.Kube, port: int) -> None:
    """Kueue's namespace, its certificate Secret, the Service its webhooks are called through, its
    CRDs (conversion pointed at ``port``) and its webhook configurations."""
    if client.get(f"/api/v1/namespaces/{NAMESPACE}") is None:
        client.create("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
    # Kueue's certificate manager fills this Secret (Kueue's manifests ship it empty); it must exist.
    secrets = f"/api/v1/namespaces/{NAMESPACE}/secrets"
    if client.get(f"{secrets}/{WEBHOOK_SECRET}") is None:
        client.create(secrets, {"metadata": {"name": WEBHOOK_SECRET, "namespace": NAMESPACE}, "type": "Opaque"})
    services = f"/api/v1/namespaces/{NAMESPACE}/services"
    client.delete(f"{services}/{WEBHOOK_SERVICE}", missing_ok=True)
    client.create(
        services,
        {
            "metadata": {"name": WEBHOOK_SERVICE, "namespace": NAMESPACE},
            "spec": {"type": "ExternalName", "externalName": "127.0.0.1"},
        },
    )
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    for definition in yaml.safe_load_all(toolchain.program_path("kueue-crds.yaml").read_text()):
        if not definition:
            continue
        name = definition["metadata"]["name"]
        if name in CONVERTED_CRDS:
            definition["spec"]["conversion"] = conversion(port)
            if client.get(f"{crds}/{name}") is not None:  # Kueue started again on this cluster: a new port
                client.patch(f"{crds}/{name}", {"spec": {"conversion": conversion(port)}})
        client.install_crd(definition)
    manifests = toolchain.program_path("kueue-webhooks.yaml").read_text()
    for configured in webhook_configurations(manifests, port):
        kind = configured["kind"].lower()
        collection = f"/apis/admissionregistration.k8s.io/v1/{kind}s"
        client.delete(f"{collection}/{configured['metadata']['name']}", missing_ok=True)
        client.create(collection, configured)


def _mount_certificate(client: kube.Kube, folder: Path) -> str | None:
    """Write the certificate Kueue put in its Secret into its certificate folder, as a kubelet mounts
    the Secret there in a cluster (Kueue waits until it finds the files)."""
    secret = client.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{WEBHOOK_SECRET}") or {}
    data = secret.get("data") or {}
    if not all(data.get(name) for name in ("ca.crt", "tls.crt", "tls.key")):
        return f"Kueue has not written its certificate into Secret {WEBHOOK_SECRET} yet"
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (folder / name).write_bytes(base64.b64decode(data[name]))
    return None


def _webhooks_not_serving(client: kube.Kube) -> str | None:
    """Kueue's validating webhook answers a dry-run ResourceFlavor (its CA is injected, it serves)."""
    flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "probe"}}
    try:
        client.create(f"{API}/resourceflavors?dryRun=All", flavor)
    except kube.KubeError as error:
        return f"Kueue's webhooks do not answer yet: {str(error)[:200]}"
    return None
