"""A fleet scaled to zero shards (an autoscaler's minReplicaCount 0, docs/autoscaling.md): no pods,
Services or endpoints are left, its status says 0 of 0 shards, and a Refit for it waits Pending
without taking the fleet's refit lock until a shard is live again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import yaml

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, conditions, reconcile, settings
from megafleet.reconcile import context
from megafleet.refits import refit_controller

ROOT = Path(__file__).resolve().parents[2]


class ServingAgents(agent_fakes.Agents):
    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [agent_client.AgentState(state="ready", weight_version=0, served_address=f"{ip}:8000") for ip in pod_ips]

    async def suspend(self, pod_ip: str, token: str, *, mode: str, timeout_seconds: float) -> None:
        pass

    async def close(self) -> None:
        pass


def test_a_fleet_at_zero_shards_has_nothing_running_and_a_refit_for_it_waits_pending() -> None:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"]["namespace"] = "rl"
    node = {"kind": "Node", "metadata": {"name": "n0", "labels": {}}, "spec": {}, "status": {"allocatable": {}}}
    api = kube_fakes.Api(manifest, node)
    agents = ServingAgents()
    runtime = context.Runtime.of(api, agents, settings.OperatorSettings())

    async def once() -> None:
        await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "tiny", "rl") or {})

    asyncio.run(once())
    api.run_pods("n0")
    asyncio.run(once())
    assert len([key for key in api.objects if key[0] == "Pod"]) == 2

    api.objects[("MegatronGeneration", "rl", "tiny")]["spec"]["replicas"] = 0  # what the HPA/KEDA write
    asyncio.run(once())
    asyncio.run(once())
    kinds = {key[0] for key in api.objects}
    assert "Pod" not in kinds and "Service" not in kinds
    status = api.objects[("MegatronGeneration", "rl", "tiny")]["status"]
    assert status["readyReplicas"] == 0 and status["replicas"] == 0 and status["endpoints"] == []
    ready = conditions.find(status["conditions"], conditions.READY) or {}
    assert (ready.get("status"), ready.get("message")) == ("True", "0 of 0 shards ready")  # nothing is missing

    refit = {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "Refit",
        "metadata": {"name": "tiny-v1", "namespace": "rl", "generation": 1},
        "spec": {"fleetRef": {"name": "tiny"}, "version": 1, "source": {"checkpoint": {"path": "/ckpt/1"}}},
    }
    api.objects[("Refit", "rl", "tiny-v1")] = refit
    asyncio.run(refit_controller.advance(runtime, refit))
    refit_status = api.objects[("Refit", "rl", "tiny-v1")]["status"]
    assert (refit_status["phase"], refit_status["message"]) == ("Pending", "no live shard to refit yet")
    assert not (api.objects[("MegatronGeneration", "rl", "tiny")]["status"].get("refit") or {}).get("active")
