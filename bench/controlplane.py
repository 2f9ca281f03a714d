"""Control-plane benchmark: apply N fleets and time endpoints published, shards placed, shards Ready.

Runs a fresh local control plane (KWOK nodes), the operator as a separate process (as a user runs
it) and, for the Ready scenario, the local pod runner with real tiny engines on CPU. Reports, per
scenario: seconds from the first apply until every fleet has its endpoints in status, until every
shard's pods are placed and Running, (Ready scenario) until every shard answers Ready; API writes
per pod (the operator's own counter); the operator's resident memory. Writes JSON with the machine.

    .venv/bin/python bench/controlplane.py --placed 10,100 --ready 10 \
        --out bench/results/controlplane-<machine>-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from megafleet.api import crd, v1alpha1
from megafleet_dev import cluster, kube, nodes, runner, toolchain

GPU_FLEET = {
    "model": {"source": "/models/llama-8b"},
    "replicas": 1,
    "parallelism": {"tensor": 8},
    "resources": {"gpusPerNode": 8},
    "placement": {"nodeSelector": {nodes.POOL_LABEL: "h200"}},
}
CPU_FLEET = {
    "model": {"source": "tiny://llama", "dtype": "float32", "maxSequenceLength": 256},
    "replicas": 1,
    "resources": {"gpusPerNode": 0, "cpu": "1", "memory": "1Gi"},
    "placement": {"tolerations": []},
    "engine": {"backend": "transformers", "maxBatchSize": 4},
}


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def operator_writes(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("megafleet_operator_api_writes_total{")
    )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fleets_path(namespace: str) -> str:
    return f"/apis/{v1alpha1.API_VERSION}/namespaces/{namespace}/megatrongenerations"


def all_fleets(count: int, check: Any) -> Any:
    return lambda items: len(items) == count and all(check(item) for item in items)


def has_endpoints(item: dict[str, Any]) -> bool:
    return len(item.get("status", {}).get("endpoints", [])) == item["spec"]["replicas"]


def is_placed(item: dict[str, Any]) -> bool:
    return (kube.condition(item, "Placed") or {}).get("status") == "True"


def is_ready(item: dict[str, Any]) -> bool:
    return (kube.condition(item, "Ready") or {}).get("status") == "True"


def pods_running(client: kube.Kube, namespace: str, count: int) -> Any:
    def check(_: list[Any]) -> bool:
        pods = client.list(f"/api/v1/namespaces/{namespace}/pods")["items"]
        return len(pods) == count and all(p.get("status", {}).get("phase") == "Running" for p in pods)

    return check


def scenario(
    client: kube.Kube, metrics_port: int, operator_pid: int, *, count: int, spec: dict[str, Any], ready: bool
) -> dict[str, Any]:
    namespace = client.create_namespace(f"bench{count}")
    before = operator_writes(metrics_port)
    say(f"applying {count} fleets into {namespace}")
    started = time.monotonic()
    for index in range(count):
        client.create(
            fleets_path(namespace),
            {
                "apiVersion": v1alpha1.API_VERSION,
                "kind": "MegatronGeneration",
                "metadata": {"name": f"f{index}"},
                "spec": spec,
            },
        )
    applied = time.monotonic() - started
    timeout = 600
    client.wait_items(fleets_path(namespace), all_fleets(count, has_endpoints), timeout=timeout, what="endpoints")
    endpoints = time.monotonic() - started
    say(f"{count} fleets: endpoints published after {endpoints:.1f} s")
    client.wait_items(fleets_path(namespace), all_fleets(count, is_placed), timeout=timeout, what="placed")
    client.wait_items(
        f"/api/v1/namespaces/{namespace}/pods",
        pods_running(client, namespace, count),
        timeout=timeout,
        what="pods Running",
    )
    placed = time.monotonic() - started
    say(f"{count} fleets: every shard placed and Running after {placed:.1f} s")
    result: dict[str, Any] = {
        "fleets": count,
        "shards": count,
        "pods": count,
        "apply_seconds": round(applied, 2),
        "endpoints_published_seconds": round(endpoints, 2),
        "placed_running_seconds": round(placed, 2),
    }
    if ready:
        client.wait_items(fleets_path(namespace), all_fleets(count, is_ready), timeout=timeout, what="Ready")
        result["all_ready_seconds"] = round(time.monotonic() - started, 2)
        say(f"{count} fleets: every shard Ready (real engines) after {result['all_ready_seconds']:.1f} s")
    result["api_writes"] = operator_writes(metrics_port) - before
    result["api_writes_per_pod"] = round(result["api_writes"] / count, 2)
    result["operator_rss_mib"] = round(rss_mib(operator_pid), 1)
    say(f"deleting {namespace}")
    client.delete(f"/api/v1/namespaces/{namespace}")
    client.wait(f"/api/v1/namespaces/{namespace}", lambda obj: obj is None, timeout=timeout, what="cleanup")
    return result


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory = next(
        int(line.split()[1]) // 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_mib": memory,
        "python": platform.python_version(),
        "kubernetes": toolchain.KUBERNETES_VERSION,
        "etcd": toolchain.ETCD_VERSION,
        "kwok": toolchain.KWOK_VERSION,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placed", default="10,100", help="fleet counts for the placement scenario (GPU nodes)")
    parser.add_argument("--ready", default="10", help="fleet counts for the Ready scenario (tiny CPU engines)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on SIGTERM too
    placed_counts = [int(n) for n in args.placed.split(",") if n]
    ready_counts = [int(n) for n in args.ready.split(",") if n]
    pools = (
        nodes.NodePool("h200", max([*placed_counts, 1]), 1, 8),
        nodes.NodePool("cpu", 1, max([*ready_counts, 1]), 0, "none", cpu="64", memory="256Gi"),
    )
    results: dict[str, Any] = {"benchmark": "controlplane", "machine": machine(), "placed": [], "ready": []}
    with tempfile.TemporaryDirectory() as state:
        local = cluster.LocalCluster(Path(state) / "cluster", pools=pools, pod_network="127.160.0.0/12", report=say)
        local.start()
        try:
            with local.kube() as client:
                for info in v1alpha1.KINDS:
                    client.install_crd(crd.definition(info))
                port = cluster.free_port()
                operator = local.spawn(
                    "operator",
                    [sys.executable, "-m", "megafleet.cli", "operator", "--metrics-port", str(port)],
                    env=dict(os.environ, KUBECONFIG=str(local.kubeconfig)),
                )
                local.wait_for("operator", lambda: None if _up(port) else "metrics not served yet")
                for count in placed_counts:  # no engines run here: GPU pods on simulated nodes
                    results["placed"].append(
                        scenario(client, port, operator.pid, count=count, spec=GPU_FLEET, ready=False)
                    )
                pod_runner = runner.Runner(client, Path(state) / "pods")
                pod_runner.start()
                try:
                    for count in ready_counts:
                        results["ready"].append(
                            scenario(client, port, operator.pid, count=count, spec=CPU_FLEET, ready=True)
                        )
                finally:
                    pod_runner.stop()
        finally:
            local.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    say(f"wrote {args.out}")
    print(json.dumps(results, indent=2))
    return 0


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
