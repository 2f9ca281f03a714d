"""The autoscale tier's configuration (megafleet_dev.autoscale): what Prometheus scrapes and how it
labels it, and that the autoscale components are built apart from the control plane."""

from __future__ import annotations

from pathlib import Path

from megafleet_dev import autoscale, toolchain


def test_prometheus_finds_engine_pods_through_the_api_server_and_labels_them_by_fleet() -> None:
    config = autoscale.prometheus_config(
        "https://127.0.0.1:6443",
        Path("/state/ca.crt"),
        Path("/state/token"),
        scrape_interval_seconds=1.5,
        static_targets=("127.0.0.1:8080",),
    )
    assert config["global"]["scrape_interval"] == "1.5s"
    engines, operator = config["scrape_configs"]
    (discovery,) = engines["kubernetes_sd_configs"]
    assert discovery["role"] == "pod" and discovery["api_server"] == "https://127.0.0.1:6443"
    assert discovery["tls_config"] == {"ca_file": "/state/ca.crt"}
    assert discovery["authorization"] == {"credentials_file": "/state/token"}
    assert discovery["selectors"] == [{"role": "pod", "label": "megafleet.dev/component=engine"}]
    relabel = engines["relabel_configs"]
    keep = {tuple(r["source_labels"]): r["regex"] for r in relabel if r.get("action") == "keep"}
    assert keep == {
        ("__meta_kubernetes_pod_container_port_name",): "metrics",
        ("__meta_kubernetes_pod_phase",): "Running",
    }
    targets = {r["target_label"]: r["source_labels"][0] for r in relabel if "target_label" in r}
    assert targets == {
        "namespace": "__meta_kubernetes_namespace",
        "pod": "__meta_kubernetes_pod_name",
        "fleet": "__meta_kubernetes_pod_label_megafleet_dev_fleet",
        "shard": "__meta_kubernetes_pod_label_megafleet_dev_shard",
    }
    assert operator["static_configs"] == [{"targets": ["127.0.0.1:8080"]}]


def test_prometheus_and_keda_are_built_only_on_demand() -> None:
    assert not set(toolchain.AUTOSCALE) & set(toolchain.CONTROL_PLANE)
    by_name = {component.name: component for component in toolchain.COMPONENTS}
    prometheus, keda = by_name["prometheus"], by_name["keda"]
    assert prometheus.tags == ("remove_all_sd", "enable_kubernetes_sd")  # one discovery, no embedded UI
    assert keda.programs == ("operator", "adapter") and keda.extras == ("keda-crds.yaml",)
    assert toolchain.program_path("keda-crds.yaml").parent.name == f"keda-{toolchain.KEDA_VERSION}"
