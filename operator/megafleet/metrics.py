"""Prometheus metrics of the operator, served on ``megafleet operator --metrics-port``.

Updated by :mod:`megafleet.kube` (every API write and read) and :mod:`megafleet.handlers` (every
reconcile, which also records each fleet's shards, weight version and refit state through
:func:`record_fleet`, and forgets a fleet once it is gone); read by Prometheus, the chart's
ServiceMonitor, the control-plane benchmark and autoscaling dashboards (docs/autoscaling.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import prometheus_client

API_WRITES = prometheus_client.Counter(
    "megafleet_operator_api_writes_total", "Kubernetes API writes by the operator.", ["verb", "kind"]
)
API_READS = prometheus_client.Counter(
    "megafleet_operator_api_reads_total", "Kubernetes API reads (get, list, watch) by the operator.", ["verb", "kind"]
)
AGENT_CALLS = prometheus_client.Counter(
    "megafleet_operator_agent_calls_total", "HTTP calls from the operator to pod agents.", ["method"]
)
RECONCILES = prometheus_client.Counter(
    "megafleet_operator_reconciles_total", "Reconciles of MegatronGeneration objects.", ["outcome"]
)
RECONCILE_SECONDS = prometheus_client.Histogram(
    "megafleet_operator_reconcile_duration_seconds",
    "Duration of one reconcile.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


FLEET_LABELS = ("namespace", "fleet")
FLEET_DESIRED_SHARDS = prometheus_client.Gauge(
    "megafleet_operator_fleet_desired_shards", "spec.replicas of each fleet (what autoscalers set).", FLEET_LABELS
)
FLEET_READY_SHARDS = prometheus_client.Gauge(
    "megafleet_operator_fleet_ready_shards", "Ready shards of each fleet (status.readyReplicas).", FLEET_LABELS
)
FLEET_WEIGHT_VERSION = prometheus_client.Gauge(
    "megafleet_operator_fleet_weight_version",
    "The fleet's current weight version (status.refit.currentVersion, else the version its shards serve).",
    FLEET_LABELS,
)
REFIT_STATES = ("idle", "refitting", "held")
"""``refitting``: a Refit holds the fleet's lock (status.refit.active); ``held``: a RefitSession
holds it (status.refit.session); scaling waits in both."""
FLEET_REFIT_STATE = prometheus_client.Gauge(
    "megafleet_operator_fleet_refit_state",
    "1 for the fleet's refit state: idle, refitting (a Refit runs) or held (a RefitSession holds it).",
    (*FLEET_LABELS, "state"),
)


def refit_state(status: Mapping[str, Any]) -> str:
    """The refit state of a fleet's status, one of :data:`REFIT_STATES`."""
    refit = status.get("refit") or {}
    if refit.get("active"):
        return "refitting"
    return "held" if refit.get("session") else "idle"


def record_fleet(namespace: str, name: str, replicas: int, status: Mapping[str, Any]) -> None:
    """Set the fleet's gauges from its spec.replicas and the status its reconcile wrote."""
    FLEET_DESIRED_SHARDS.labels(namespace, name).set(replicas)
    FLEET_READY_SHARDS.labels(namespace, name).set(int(status.get("readyReplicas") or 0))
    version = (status.get("refit") or {}).get("currentVersion", status.get("weightVersion"))
    if version is None:
        _forget(FLEET_WEIGHT_VERSION, (namespace, name))
    else:
        FLEET_WEIGHT_VERSION.labels(namespace, name).set(int(version))
    current = refit_state(status)
    for state in REFIT_STATES:
        FLEET_REFIT_STATE.labels(namespace, name, state).set(1.0 if state == current else 0.0)


def forget_fleet(namespace: str, name: str) -> None:
    """Drop a deleted fleet's series, so dashboards and autoscalers stop seeing it."""
    for gauge in (FLEET_DESIRED_SHARDS, FLEET_READY_SHARDS, FLEET_WEIGHT_VERSION):
        _forget(gauge, (namespace, name))
    for state in REFIT_STATES:
        _forget(FLEET_REFIT_STATE, (namespace, name, state))


def _forget(gauge: prometheus_client.Gauge, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):  # never recorded
        gauge.remove(*labels)


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Start the metrics HTTP server in a background thread."""
    prometheus_client.start_http_server(port, addr=host)
