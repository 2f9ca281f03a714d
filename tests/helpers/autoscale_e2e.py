"""Shared by the autoscale tier's end-to-end tests (tests/e2e/test_autoscale.py,
tests/e2e/test_nemo_autoscale_held.py; it holds no tests): the chart's ScaledObject for a fleet,
rendered by helm with test settings, made live (KEDA's HPA reading the external metric), and the
fleet's series as Prometheus has them. Prometheus and KEDA themselves are the ``autoscaler`` fixture
(tests/e2e/conftest.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from megafleet.objects import Object
from megafleet_dev import autoscale, kube, toolchain

ROOT = Path(__file__).resolve().parents[2]
WAIT = 180
SCRAPE_SECONDS = 1.0
HPA_SYNC_SECONDS = 15
"""kube-controller-manager's HPA sync period (its default; the local cluster keeps it)."""


def scaled_objects(namespace: str) -> str:
    return f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects"


def hpa(namespace: str, fleet: str) -> str:
    """The HPA KEDA makes for the fleet's ScaledObject."""
    return f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/keda-hpa-{fleet}"


def scaled_object(namespace: str, prometheus_url: str, fleet: str, settings: Mapping[str, Any]) -> Object:
    """The chart's ScaledObject for ``fleet`` (helm template with ``autoscaling.*`` values: the
    fleet's entry carries ``settings``)."""
    values = {"autoscaling": {"prometheusAddress": prometheus_url, "fleets": [{"name": fleet, **settings}]}}
    rendered = subprocess.run(
        [
            str(toolchain.program_path("helm")),
            "template",
            "megafleet",
            str(ROOT / "charts" / "megafleet"),
            "--namespace",
            namespace,
            "--show-only",
            "templates/scaledobjects.yaml",
            "--values",
            "-",
        ],
        input=yaml.safe_dump(values),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    (document,) = [doc for doc in yaml.safe_load_all(rendered) if doc]
    assert document["kind"] == "ScaledObject" and document["metadata"]["namespace"] == namespace
    return dict(document)


def autoscale_fleet(
    kube_admin: kube.Kube, namespace: str, prometheus_url: str, fleet: str, settings: Mapping[str, Any]
) -> None:
    """Create the fleet's ScaledObject and wait until KEDA made its HPA and the HPA reads the metric."""
    kube_admin.create(scaled_objects(namespace), scaled_object(namespace, prometheus_url, fleet, settings))
    ready = kube_admin.wait(
        f"{scaled_objects(namespace)}/{fleet}",
        lambda o: (kube.condition(o, "Ready") or {}).get("status") == "True",
        timeout=WAIT,
        what="the ScaledObject Ready",
    )
    assert ready is not None
    found = kube_admin.wait(
        hpa(namespace, fleet),
        lambda o: (kube.condition(o, "ScalingActive") or {}).get("status") == "True",
        timeout=WAIT,
        what="the HPA reading the external metric",
    )
    assert found is not None
    assert found["spec"]["scaleTargetRef"] == {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "MegatronGeneration",
        "name": fleet,
    }
    assert (found["spec"]["minReplicas"], found["spec"]["maxReplicas"]) == (
        settings["minReplicas"],
        settings["maxReplicas"],
    )


def metric(prometheus_url: str, name: str, namespace: str, fleet: str, *, shard: int | None = None) -> float:
    """``sum(name)`` over the fleet's series (of one ``shard``'s pods when given), 0 when Prometheus
    has none."""
    selector = f'namespace="{namespace}",fleet="{fleet}"' + ("" if shard is None else f',shard="{shard}"')
    found = autoscale.query(prometheus_url, f"sum({name}{{{selector}}})")
    return found or 0.0
