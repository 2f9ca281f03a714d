"""Microbenchmark: the operator's CPU per Kubernetes API request, by transport (what moved the operator's
requests to aiohttp: bench/HISTORY.md, "sixth session" of ``controlplane.py``).

:class:`megafleet.kube.Api` sends the operator's requests over :mod:`megafleet.kube_rest` (aiohttp)
and a lightkube client's over lightkube (httpx). This starts a fresh local control plane (one KWOK
node) and, for each transport in turn, creates, reads, merge-patches and deletes ``--count``
ConfigMaps of about 2 KB, ``--concurrency`` requests in flight (the operator's own bound), and
reports the CPU this process spent per request of each verb (``time.process_time``: the client's
work only; the API server runs in its own processes). The transports alternate for ``--rounds``
rounds so the machine's background load falls on both alike; the JSON holds every round and the
medians, with the machine details.

    .venv/bin/python bench/api_client.py --out bench/results/api-client-cpu2-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import lightkube
from lightkube.config.kubeconfig import KubeConfig

from megafleet import kube, kube_rest, names
from megafleet_dev import cluster, nodes

sys.path.insert(0, str(Path(__file__).parent))
import controlplane  # the machine details

TRANSPORTS = ("rest", "lightkube")
VERBS = ("create", "get", "patch", "delete")


def say(message: str) -> None:
    print(f"[api-client] {message}", flush=True)


def api_for(kubeconfig: Path, transport: str, concurrency: int) -> kube.Api:
    config = KubeConfig.from_file(kubeconfig)
    if transport == "lightkube":
        client = lightkube.AsyncClient(config=config, field_manager=names.FIELD_MANAGER)
        return kube.Api(client, concurrency=concurrency)
    single = config.get()
    assert single is not None
    rest = kube_rest.from_config(
        single, field_manager=names.FIELD_MANAGER, user_agent=kube.USER_AGENT, connections=concurrency
    )
    assert rest is not None
    return kube.Api(rest, concurrency=concurrency)


def config_map(index: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"bench-{index}", "namespace": "default", "labels": {"bench": "api-client"}},
        "data": {"payload": "x" * 2048},
    }


async def one_round(kubeconfig: Path, transport: str, count: int, concurrency: int) -> dict[str, float]:
    """CPU milliseconds per request of each verb, and the round's wall seconds."""
    api = api_for(kubeconfig, transport, concurrency)
    steps: dict[str, Callable[[int], Awaitable[Any]]] = {
        "create": lambda i: api.create(config_map(i)),
        "get": lambda i: api.get("ConfigMap", f"bench-{i}", "default"),
        "patch": lambda i: api.patch("ConfigMap", f"bench-{i}", "default", {"data": {"more": str(i)}}),
        "delete": lambda i: api.delete("ConfigMap", f"bench-{i}", "default"),
    }
    found: dict[str, float] = {}
    started = time.monotonic()
    try:
        for verb in VERBS:
            before = time.process_time()
            await asyncio.gather(*(steps[verb](i) for i in range(count)))
            found[verb] = round((time.process_time() - before) / count * 1e3, 3)
    finally:
        await api.close()
    found["wall_seconds"] = round(time.monotonic() - started, 2)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=1000, help="objects per verb and round (default 1000)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32, the operator's)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per transport, alternating (default 3)")
    parser.add_argument("--out", type=Path, help="write the results here (JSON)")
    args = parser.parse_args()

    results: dict[str, Any] = {
        "benchmark": "api-client",
        "machine": controlplane.machine(),
        "count": args.count,
        "concurrency": args.concurrency,
        "rounds": {transport: [] for transport in TRANSPORTS},
    }
    with tempfile.TemporaryDirectory() as tmp:
        local = cluster.LocalCluster(Path(tmp) / "cluster", pools=(nodes.NodePool("h200", 1, 1, 8),), report=say)
        local.start()
        try:
            for round_index in range(args.rounds):
                for transport in TRANSPORTS:
                    say(f"round {round_index + 1}/{args.rounds}: {transport}, {args.count} requests per verb")
                    found = asyncio.run(one_round(local.kubeconfig, transport, args.count, args.concurrency))
                    say(f"  CPU ms per request: {found}")
                    results["rounds"][transport].append(found)
        finally:
            local.stop()
    results["median_cpu_ms_per_request"] = {
        transport: {verb: statistics.median(r[verb] for r in rounds) for verb in VERBS}
        for transport, rounds in results["rounds"].items()
    }
    rest, light = (results["median_cpu_ms_per_request"][t] for t in TRANSPORTS)
    results["lightkube_over_rest"] = {verb: round(light[verb] / rest[verb], 2) for verb in VERBS}
    say(f"median CPU ms per request: {json.dumps(results['median_cpu_ms_per_request'])}")
    say(f"lightkube's CPU over the REST transport's: {results['lightkube_over_rest']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
