"""The reconcile sequence against an in-memory API (tests/helpers/kube_fakes.py): the first pass reserves
endpoints and places every shard, a settled fleet is Ready, and reconciling it again writes nothing.
The same property against the real control plane: tests/e2e/test_reconcile_idle.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, conditions, reconcile, settings
from megafleet.reconcile import context

ROOT = Path(__file__).resolve().parents[3]


class ServingAgents(agent_fakes.Agents):
    """Every agent answers Ready at version 1, serving on its pod's frontend port."""

    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [agent_client.AgentState(state="ready", weight_version=1, served_address=f"{ip}:8000") for ip in pod_ips]

    async def close(self) -> None:
        pass


def test_a_settled_fleet_is_ready_and_its_next_reconcile_writes_nothing() -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"]["namespace"] = "rl"
    node = {"kind": "Node", "metadata": {"name": "n0", "labels": {}}, "spec": {}, "status": {"allocatable": {}}}
    api = kube_fakes.Api(manifest, node)
    runtime = context.Runtime.of(api, ServingAgents(), settings.OperatorSettings())

    async def reconcile_once() -> dict[str, int]:
        api.writes.clear()
        await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "tiny", "rl") or {})
        return dict(api.writes)

    first = asyncio.run(reconcile_once())
    assert first["create Pod"] == 2 and first["create Service"] == 1 and first["create ConfigMap"] == 1
    api.run_pods("n0")
    asyncio.run(reconcile_once())
    fleet = asyncio.run(api.get("MegatronGeneration", "tiny", "rl")) or {}
    assert fleet["status"]["readyReplicas"] == 2 and fleet["status"]["weightVersion"] == 1
    for kind in (conditions.READY, conditions.PLACED, conditions.WEIGHTS_CURRENT, conditions.ENDPOINTS_VERIFIED):
        assert (conditions.find(fleet["status"]["conditions"], kind) or {}).get("status") == "True", kind
    assert asyncio.run(reconcile_once()) == {}
