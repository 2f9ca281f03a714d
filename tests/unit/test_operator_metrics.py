"""The operator's per-fleet gauges: recorded from the status a reconcile ended with, a refit's lock
and a session's hold read as the refit state, and a deleted fleet's series dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import prometheus_client
import yaml

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, metrics, reconcile, settings
from megafleet.reconcile import context

ROOT = Path(__file__).resolve().parents[2]


def sample(name: str, **labels: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


def test_a_fleet_s_shards_version_and_refit_state_are_recorded_and_forgotten() -> None:
    status = {"readyReplicas": 2, "weightVersion": 3, "refit": {"currentVersion": 4, "active": "gen-v5"}}
    metrics.record_fleet("rl", "gen", 3, status)
    fleet = {"namespace": "rl", "fleet": "gen"}
    assert sample("megafleet_operator_fleet_desired_shards", **fleet) == 3
    assert sample("megafleet_operator_fleet_ready_shards", **fleet) == 2
    assert sample("megafleet_operator_fleet_weight_version", **fleet) == 4
    states = {s: sample("megafleet_operator_fleet_refit_state", **fleet, state=s) for s in metrics.REFIT_STATES}
    assert states == {"idle": 0, "refitting": 1, "held": 0}

    metrics.record_fleet("rl", "gen", 1, {"readyReplicas": 1, "refit": {"session": "s", "currentVersion": 5}})
    assert sample("megafleet_operator_fleet_refit_state", **fleet, state="held") == 1
    assert sample("megafleet_operator_fleet_refit_state", **fleet, state="refitting") == 0

    metrics.forget_fleet("rl", "gen")
    metrics.forget_fleet("rl", "gen")  # twice: nothing left to drop is fine
    assert sample("megafleet_operator_fleet_ready_shards", **fleet) is None
    assert sample("megafleet_operator_fleet_refit_state", **fleet, state="idle") is None


class ServingAgents(agent_fakes.Agents):
    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [agent_client.AgentState(state="ready", weight_version=1, served_address=f"{ip}:8000") for ip in pod_ips]

    async def close(self) -> None:
        pass


def test_the_reconcile_returns_the_status_it_wrote() -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"]["namespace"] = "rl"
    node = {"kind": "Node", "metadata": {"name": "n0", "labels": {}}, "spec": {}, "status": {"allocatable": {}}}
    api = kube_fakes.Api(manifest, node)
    runtime = context.Runtime.of(api, ServingAgents(), settings.OperatorSettings())

    async def once() -> dict[str, object] | None:
        return await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "tiny", "rl") or {})

    asyncio.run(once())
    api.run_pods("n0")
    returned = asyncio.run(once())
    stored = (asyncio.run(api.get("MegatronGeneration", "tiny", "rl")) or {})["status"]
    assert returned == stored and stored["readyReplicas"] == 2
