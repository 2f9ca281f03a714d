"""Prometheus metrics of the operator, served on ``megafleet operator --metrics-port``.

Updated by :mod:`megafleet.kube` (every API write and read) and :mod:`megafleet.handlers` (every
reconcile); read by Prometheus, the chart's ServiceMonitor and the control-plane benchmark.
"""

from __future__ import annotations

import prometheus_client

API_WRITES = prometheus_client.Counter(
    "megafleet_operator_api_writes_total", "Kubernetes API writes by the operator.", ["verb", "kind"]
)
API_READS = prometheus_client.Counter(
    "megafleet_operator_api_reads_total", "Kubernetes API reads (get, list) by the operator.", ["verb", "kind"]
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


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Start the metrics HTTP server in a background thread."""
    prometheus_client.start_http_server(port, addr=host)
