"""Microbenchmark: how fast does kube-apiserver create ClusterIP Services, and where does a create's
time go? (The control-plane benchmark's megafleet runs are paced by Service creates:
docs/incidents.md#clusterip-service-creates.)

Starts a fresh local control plane (optionally with the control-plane benchmark's KWOK H200 nodes and
audit log), then for each concurrency creates ``--count`` ClusterIP Services shaped like the
operator's frontend Services (a selector, one port) in a fresh namespace, and reports the client's
latencies, the rate, and the API server's own metrics over the burst (request duration by
resource, etcd request durations, the ClusterIP allocator's, APF waits), plus the CPU seconds of
every control-plane process during it.

    .venv/bin/python bench/service_creates.py --nodes 1000 --concurrency 1,8,32 --out /tmp/svc.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from megafleet import names
from megafleet_dev import cluster, nodes

sys.path.insert(0, str(Path(__file__).parent))
import controlplane  # the benchmark's audit policy and CPU accounting

METRIC = re.compile(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf)$")
WATCHED = (
    "apiserver_request_duration_seconds_sum",
    "apiserver_request_duration_seconds_count",
    "apiserver_request_sli_duration_seconds_sum",
    "etcd_request_duration_seconds_sum",
    "etcd_request_duration_seconds_count",
    "kube_apiserver_clusterip_allocator_allocation_duration_seconds_sum",
    "kube_apiserver_clusterip_allocator_allocation_duration_seconds_count",
    "kube_apiserver_clusterip_allocator_allocation_errors_total",
    "apiserver_flowcontrol_request_wait_duration_seconds_sum",
    "apiserver_flowcontrol_request_wait_duration_seconds_count",
    "apiserver_admission_step_admission_duration_seconds_sum",
    "apiserver_admission_controller_admission_duration_seconds_sum",
    "apiserver_admission_webhook_admission_duration_seconds_sum",
    "apiserver_watch_events_total",
    "apiserver_watch_cache_events_dispatched_total",
    "process_cpu_seconds_total",
    "go_gc_duration_seconds_sum",
)
KEEP_LABELS = ("verb", "resource", "operation", "type", "priority_level", "name", "scope", "cidr", "execute", "kind")


def say(message: str) -> None:
    print(f"[svc] {message}", file=sys.stderr, flush=True)


def scrape(http: httpx.Client) -> dict[str, float]:
    """The watched series of the API server's /metrics, keyed by name and the labels kept."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in http.get("/metrics").text.splitlines():
        match = METRIC.match(line)
        if not match or match.group(1) not in WATCHED:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        kept = ",".join(f"{k}={labels[k]}" for k in KEEP_LABELS if k in labels)
        out[f"{match.group(1)}{{{kept}}}"] += float(match.group(3))
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 4) for k, v in after.items() if abs(v - before.get(k, 0.0)) > 1e-9}


def service(index: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        # labelled as the operator's: an operator running beside the burst indexes them as its own
        "metadata": {"name": f"svc-{index}", "labels": {names.LABEL_FLEET: "bench", "shard": str(index)}},
        "spec": {
            "type": "ClusterIP",
            "selector": {"bench": "svc", "shard": str(index)},
            "ports": [{"name": "http", "protocol": "TCP", "port": 8000, "targetPort": 8000}],
        },
    }


async def burst(server: str, token: str, ca: str, namespace: str, count: int, concurrency: int) -> list[float]:
    """``count`` creates, ``concurrency`` in flight; each create's client-side latency."""
    context = ssl.create_default_context(cafile=ca)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    slots = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    async with httpx.AsyncClient(
        base_url=server, verify=context, headers={"Authorization": f"Bearer {token}"}, limits=limits, timeout=120
    ) as http:

        async def one(index: int) -> None:
            async with slots:
                started = time.monotonic()
                response = await http.post(f"/api/v1/namespaces/{namespace}/services", json=service(index))
                latencies.append(time.monotonic() - started)
                if response.status_code != 201:
                    raise RuntimeError(f"create {index}: {response.status_code} {response.text[:300]}")

        await asyncio.gather(*(one(i) for i in range(count)))
    return latencies


def _serving(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1, help="simulated 8-GPU H200 nodes (KWOK heartbeats them)")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--audit", action="store_true", help="the control-plane benchmark's audit log on")
    parser.add_argument("--apiserver-arg", action="append", default=[], help="one more kube-apiserver flag")
    parser.add_argument("--pod-network", default="127.176.0.0/12")
    parser.add_argument("--operator", action="store_true", help="the operator runs (idle: no fleet) beside")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to wait after the nodes are Ready")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results: dict[str, Any] = {"nodes": args.nodes, "audit": args.audit, "apiserver_args": args.apiserver_arg}
    results["runs"] = []
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        extra = list(args.apiserver_arg)
        if args.audit:
            policy = state / "audit-policy.yaml"
            policy.write_text(yaml.safe_dump(controlplane.AUDIT_POLICY))
            extra += [
                f"--audit-policy-file={policy}",
                f"--audit-log-path={state / 'audit.log'}",
                "--audit-log-format=json",
                "--audit-log-maxsize=1000000",
            ]
        cluster.START_TIMEOUT_SECONDS = 600.0
        local = cluster.LocalCluster(
            state / "cluster",
            pools=(nodes.NodePool("h200", max(args.nodes, 1), 1, 8),),
            pod_network=args.pod_network,
            report=say,
            apiserver_args=tuple(extra),
        )
        local.start()
        try:
            with local.kube() as client:
                pids = {r.name: r.pid for r in local._records}
                token = local.token_file.read_text().strip()
                if args.operator:
                    port = cluster.free_port()
                    record = local.spawn(
                        "operator",
                        [sys.executable, "-m", "megafleet.cli", "operator", "--metrics-port", str(port)],
                        env=dict(os.environ, KUBECONFIG=str(local.kubeconfig)),
                    )
                    local.wait_for("operator", lambda: None if _serving(port) else "not serving")
                    pids["operator"] = record.pid
                idle_before = {name: controlplane.tree_cpu_seconds(pid) for name, pid in pids.items()}
                time.sleep(args.hold)
                if args.hold:
                    results["idle_cpu_seconds_per_minute"] = {
                        name: round((controlplane.tree_cpu_seconds(pid) - idle_before[name]) * 60 / args.hold, 2)
                        for name, pid in pids.items()
                    }
                    say(f"idle: {results['idle_cpu_seconds_per_minute']}")
                for concurrency in [int(c) for c in args.concurrency.split(",")]:
                    namespace = client.create_namespace(f"svc-c{concurrency}")
                    cpu_before = {name: controlplane.tree_cpu_seconds(pid) for name, pid in pids.items()}
                    metrics_before = scrape(client._http)
                    load = os.getloadavg()[0]
                    started = time.monotonic()
                    latencies = asyncio.run(
                        burst(client.server, token, str(local.ca_file), namespace, args.count, concurrency)
                    )
                    wall = time.monotonic() - started
                    metrics = delta(metrics_before, scrape(client._http))
                    cpu = {
                        name: round(controlplane.tree_cpu_seconds(pid) - cpu_before[name], 2)
                        for name, pid in pids.items()
                    }
                    latencies.sort()
                    run = {
                        "concurrency": concurrency,
                        "count": args.count,
                        "load_average_before": load,
                        "seconds": round(wall, 2),
                        "per_second": round(args.count / wall, 1),
                        "latency_median_ms": round(statistics.median(latencies) * 1000, 1),
                        "latency_p90_ms": round(latencies[int(0.9 * len(latencies))] * 1000, 1),
                        "latency_max_ms": round(latencies[-1] * 1000, 1),
                        "cpu_seconds": cpu,
                        "metrics": metrics,
                    }
                    say(json.dumps({k: v for k, v in run.items() if k != "metrics"}))
                    results["runs"].append(run)
                    args.out.write_text(json.dumps(results, indent=2) + "\n")
                    client.delete(f"/api/v1/namespaces/{namespace}")
                    client.wait(f"/api/v1/namespaces/{namespace}", lambda o: o is None, timeout=600, what="cleanup")
        finally:
            local.stop()
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
