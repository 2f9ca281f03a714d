"""The main job of ``megafleet dev up``: CRDs, the operator, the pod runner and the tiny CPU fleet.

Called by :mod:`megafleet_dev.cli` once the control plane is ready. Everything it starts is a
process of the local cluster, so ``megafleet dev down`` stops it too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

from megafleet.api import crd, v1alpha1
from megafleet_dev import cluster, kube

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
NAMESPACE = "default"
READY_TIMEOUT_SECONDS = 300.0
PEERING = "megafleet"
REAL_NODE_LABEL = "megafleet.dev/real-node"  # realnode.REAL_NODE_LABEL (demo stays free of realnode)


def _fleet_path() -> str:
    return f"/apis/{v1alpha1.API_VERSION}/namespaces/{NAMESPACE}/megatrongenerations/tiny"


def start(local: cluster.LocalCluster, *, real_node: bool = False) -> None:
    """Install the CRDs, start the operator and the runner, apply the tiny fleet, wait until Ready.
    With ``real_node`` the fleet is placed on the real node (containers from the engine image)."""
    with local.kube() as client:
        for definition in [*(crd.definition(info) for info in v1alpha1.KINDS), crd.peering_definition()]:
            client.install_crd(definition)
        client.create(
            f"/apis/{crd.PEERING_GROUP}/v1/clusterkopfpeerings",
            {
                "apiVersion": f"{crd.PEERING_GROUP}/v1",
                "kind": "ClusterKopfPeering",
                "metadata": {"name": PEERING},
            },
        )
        env = dict(os.environ, KUBECONFIG=str(local.kubeconfig))
        local.spawn("operator", [sys.executable, "-m", "megafleet.cli", "operator", "--peering", PEERING], env=env)
        local.spawn(
            "pod-runner",
            [sys.executable, "-m", "megafleet.cli", "dev", "--state-dir", str(local.state_dir), "runner"],
            env=env,
        )
        manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
        if real_node:
            manifest["spec"]["placement"]["nodeSelector"] = {REAL_NODE_LABEL: "true"}
        client.create(_fleet_path().rsplit("/", 1)[0], manifest)
        local.report("applied examples/tiny-cpu.yaml; waiting for the fleet to become Ready (engines start on CPU)")
        client.wait(
            _fleet_path(),
            lambda obj: (kube.condition(obj, "Ready") or {}).get("status") == "True",
            timeout=READY_TIMEOUT_SECONDS,
            what="the tiny fleet to become Ready",
        )


def usage(local: cluster.LocalCluster) -> list[str]:
    """Lines telling a person how to talk to the sample fleet from this machine."""
    with local.kube() as client:
        fleet = client.get(_fleet_path()) or {}
        shards = fleet.get("status", {}).get("shards", [])
        pod = client.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{shards[0]['pods'][0]}") if shards else None
    status = fleet.get("status", {})
    lines = [f"\nfleet {NAMESPACE}/tiny is Ready: {len(shards)} shards, weight version {status.get('weightVersion')}"]
    lines += [f"  shard {e['shard']}: {e['url']}  ({e['dnsURL']})" for e in status.get("endpoints", [])]
    if pod is not None:
        url = f"http://{pod['status']['podIP']}:8000/v1/chat/completions"
        body = '{"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
        lines.append(
            "\nThe frontends listen on their pod IPs (loopback, or routed to the real node). Send a chat completion:"
        )
        lines.append(f"\n  curl -s {url} -H 'Content-Type: application/json' -d '{body}'")
    return lines
