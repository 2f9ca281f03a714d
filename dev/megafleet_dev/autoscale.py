"""Prometheus and KEDA beside the local control plane: the real components that autoscale a fleet.

Used by ``megafleet dev up --autoscale`` (:mod:`megafleet_dev.cli`) and the autoscale tier's tests
(``tests/e2e/test_autoscale.py``). :func:`start` builds the two components on first use
(:data:`megafleet_dev.toolchain.AUTOSCALE`, never with the rest of the control plane) and starts,
as processes of the :class:`~megafleet_dev.cluster.LocalCluster` (so ``megafleet dev down`` stops
them too):

- **Prometheus**, discovering engine pods through Kubernetes service discovery against the local
  API server (``role: pod``, the pods' ``metrics`` container port): the pod runner binds every
  engine to its loopback pod IP, so the address the API server reports is the one to scrape, and a
  pod created or deleted by a scale shows up or goes away without regenerating anything. A static
  config generated from pods would need a watcher of its own and a reload per change.
- **KEDA's operator** (ScaledObject controller; it owns one HPA per ScaledObject) and its **metrics
  API server** (``external.metrics.k8s.io``), registered as an APIService so the HPA controller in
  kube-controller-manager reads the external metric. The API server reaches it through an
  ``ExternalName`` Service naming 127.0.0.1 (ClusterIPs lead nowhere here) and verifies it with a
  CA generated here (``caBundle``); the operator's gRPC metrics service and the adapter use
  certificates from the same CA (mutual TLS, as KEDA requires). KEDA's admission webhooks are not
  run (nothing validates ScaledObjects beyond their CRD schema).

Invariant: every listener is on 127.0.0.1 on a free port, except KEDA adapter's own /metrics
server, which KEDA binds on all addresses (``:<port>``; it only serves metrics).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import yaml

from megafleet_dev import cluster, kube, pki, toolchain

KEDA_NAMESPACE = "keda"
METRICS_API = "v1beta1.external.metrics.k8s.io"
METRICS_SERVICE = "keda-metrics-apiserver"
ENGINE_SELECTOR = "megafleet.dev/component=engine"
SCRAPE_JOB = "megafleet-engines"


@dataclasses.dataclass(frozen=True)
class Autoscale:
    """What :func:`start` started: where Prometheus answers, and the processes to stop."""

    prometheus_url: str
    keda_metrics_port: int
    records: tuple[cluster.ProcessRecord, ...]


def prometheus_config(
    api_server: str,
    ca_file: Path,
    token_file: Path,
    *,
    scrape_interval_seconds: float,
    static_targets: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Prometheus's configuration: every engine pod's ``metrics`` port, found through the API
    server, labelled ``namespace``, ``pod``, ``fleet`` and ``shard`` (what ScaledObject queries
    select on); ``static_targets`` (``host:port``) are scraped as job ``megafleet-operator``."""
    interval = f"{scrape_interval_seconds:g}s"
    pod_label = "__meta_kubernetes_pod_label_megafleet_dev_"
    engines: dict[str, Any] = {
        "job_name": SCRAPE_JOB,
        "kubernetes_sd_configs": [
            {
                "role": "pod",
                "api_server": api_server,
                "tls_config": {"ca_file": str(ca_file)},
                "authorization": {"credentials_file": str(token_file)},
                "selectors": [{"role": "pod", "label": ENGINE_SELECTOR}],
            }
        ],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Running", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": [f"{pod_label}fleet"], "target_label": "fleet"},
            {"source_labels": [f"{pod_label}shard"], "target_label": "shard"},
        ],
    }
    jobs = [engines]
    if static_targets:
        jobs.append({"job_name": "megafleet-operator", "static_configs": [{"targets": list(static_targets)}]})
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": jobs,
    }


def start(
    local: cluster.LocalCluster,
    *,
    scrape_interval_seconds: float = 2.0,
    static_targets: tuple[str, ...] = (),
) -> Autoscale:
    """Build (once) and start Prometheus and KEDA for ``local``; returns when Prometheus is ready,
    KEDA's CRDs are Established and the external metrics APIService is Available."""
    toolchain.ensure_built(toolchain.AUTOSCALE, report=local.report)
    folder = local.state_dir / "autoscale"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started: list[cluster.ProcessRecord] = []
    try:
        prometheus_url = _start_prometheus(local, folder, scrape_interval_seconds, static_targets, started)
        metrics_port = _start_keda(local, folder, started)
    except BaseException:
        local.stop_processes(started)
        raise
    return Autoscale(prometheus_url=prometheus_url, keda_metrics_port=metrics_port, records=tuple(started))


def stop(local: cluster.LocalCluster, running: Autoscale) -> None:
    """Remove the APIService (the API server would keep probing it) and stop KEDA and Prometheus."""
    with local.kube() as client:
        client.delete(f"/apis/apiregistration.k8s.io/v1/apiservices/{METRICS_API}", missing_ok=True)
    local.stop_processes(list(running.records))


def query(prometheus_url: str, promql: str) -> float | None:
    """The value of an instant PromQL query that returns one sample (or a scalar); None when empty."""
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": promql}, timeout=10)
    response.raise_for_status()
    data = response.json()["data"]
    if data["resultType"] == "scalar":
        return float(data["result"][1])
    results = data["result"]
    return float(results[0]["value"][1]) if results else None


def _start_prometheus(
    local: cluster.LocalCluster,
    folder: Path,
    interval: float,
    static_targets: tuple[str, ...],
    started: list[cluster.ProcessRecord],
) -> str:
    config = prometheus_config(
        f"https://127.0.0.1:{local.api_port}",
        local.ca_file,
        local.token_file,
        scrape_interval_seconds=interval,
        static_targets=static_targets,
    )
    config_file = folder / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    port = cluster.free_port()
    started.append(
        local.spawn(
            "prometheus",
            [
                str(toolchain.program_path("prometheus")),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={folder / 'tsdb'}",
                "--storage.tsdb.retention.time=2h",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
        )
    )
    url = f"http://127.0.0.1:{port}"
    local.wait_for("prometheus", functools.partial(cluster.http_not_ok, f"{url}/-/ready"))
    return url


def _start_keda(local: cluster.LocalCluster, folder: Path, started: list[cluster.ProcessRecord]) -> int:
    certs = folder / "certs"
    certs.mkdir()
    pki.make_ca(folder / "keda-ca", common_name="megafleet-dev-keda-ca")
    # The API server checks the adapter's certificate against the Service's DNS name, gRPC against
    # the address it dials.
    service_name = f"{METRICS_SERVICE}.{KEDA_NAMESPACE}.svc"
    pki.issue(folder / "keda-ca", folder / "keda", "keda", server_ips=("127.0.0.1",), server_names=(service_name,))
    # KEDA reads these three names from its certificate folder (gRPC mutual TLS, adapter serving).
    shutil.copy(folder / "keda-ca.crt", certs / "ca.crt")
    shutil.copy(folder / "keda.crt", certs / "tls.crt")
    shutil.copy(folder / "keda.key", certs / "tls.key")
    (folder / "custom-ca").mkdir()

    with local.kube() as client:
        if client.get(f"/api/v1/namespaces/{KEDA_NAMESPACE}") is None:
            client.create("/api/v1/namespaces", {"metadata": {"name": KEDA_NAMESPACE}})
        for definition in yaml.safe_load_all(toolchain.program_path("keda-crds.yaml").read_text()):
            if definition:  # KEDA's files start with '---': empty documents between them
                client.install_crd(definition)

    env = dict(
        os.environ,
        KUBECONFIG=str(local.kubeconfig),
        WATCH_NAMESPACE="",
        POD_NAMESPACE=KEDA_NAMESPACE,
        KEDA_CLUSTER_OBJECT_NAMESPACE=KEDA_NAMESPACE,
    )
    grpc_port, operator_metrics, probes = cluster.free_port(), cluster.free_port(), cluster.free_port()
    started.append(
        local.spawn(
            "keda-operator",
            [
                str(toolchain.program_path("operator")),
                "--leader-elect=false",
                f"--metrics-bind-address=127.0.0.1:{operator_metrics}",
                f"--health-probe-bind-address=127.0.0.1:{probes}",
                f"--metrics-service-bind-address=127.0.0.1:{grpc_port}",
                f"--cert-dir={certs}",
                "--enable-cert-rotation=false",
                f"--ca-dir={folder / 'custom-ca'}",
                "--zap-log-level=info",
            ],
            env=env,
        )
    )
    local.wait_for("keda-operator", functools.partial(cluster.http_not_ok, f"http://127.0.0.1:{probes}/readyz"))

    secure_port, adapter_metrics = cluster.free_port(), cluster.free_port()
    kubeconfig = str(local.kubeconfig)
    started.append(
        local.spawn(
            "keda-adapter",
            [
                str(toolchain.program_path("adapter")),
                "--bind-address=127.0.0.1",
                f"--secure-port={secure_port}",
                f"--cert-dir={certs}",
                f"--tls-cert-file={certs / 'tls.crt'}",
                f"--tls-private-key-file={certs / 'tls.key'}",
                f"--lister-kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--metrics-service-address=127.0.0.1:{grpc_port}",
                f"--port={adapter_metrics}",
                "--zap-log-level=info",
            ],
            env=env,
        )
    )
    ca_bundle = base64.b64encode((folder / "keda-ca.crt").read_bytes()).decode()
    with local.kube() as client:
        _register(client, secure_port, ca_bundle)
        local.wait_for("keda-adapter", functools.partial(_not_available, client))
    return adapter_metrics


def _register(client: kube.Kube, port: int, ca_bundle: str) -> None:
    """The ExternalName Service and the APIService that send external metrics to the adapter."""
    service = {
        "metadata": {"name": METRICS_SERVICE, "namespace": KEDA_NAMESPACE},
        "spec": {"type": "ExternalName", "externalName": "127.0.0.1"},
    }
    services = f"/api/v1/namespaces/{KEDA_NAMESPACE}/services"
    client.delete(f"{services}/{METRICS_SERVICE}", missing_ok=True)
    client.create(services, service)
    api_service = {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": METRICS_API},
        "spec": {
            "group": "external.metrics.k8s.io",
            "version": "v1beta1",
            "service": {"namespace": KEDA_NAMESPACE, "name": METRICS_SERVICE, "port": port},
            "caBundle": ca_bundle,
            "groupPriorityMinimum": 100,
            "versionPriority": 100,
        },
    }
    api_services = "/apis/apiregistration.k8s.io/v1/apiservices"
    client.delete(f"{api_services}/{METRICS_API}", missing_ok=True)
    client.create(api_services, api_service)


def _not_available(client: kube.Kube) -> str | None:
    found = client.get(f"/apis/apiregistration.k8s.io/v1/apiservices/{METRICS_API}")
    available = kube.condition(found, "Available") or {}
    if available.get("status") == "True":
        return None
    return f"APIService {METRICS_API} not Available: {available.get('message', 'no condition yet')}"
