"""A fleet never adopts, reads, publishes or deletes what it does not own, against an
in-memory API (tests/helpers/kube_fakes.py); the same against the real control plane:
tests/e2e/test_hostile_specs.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import yaml

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, conditions, kube, names, reconcile, settings
from megafleet.fleet_state import token
from megafleet.reconcile import context, validate

ROOT = Path(__file__).resolve().parents[3]
NODE = {"kind": "Node", "metadata": {"name": "n0", "labels": {}}, "spec": {}, "status": {"allocatable": {}}}


class Agents(agent_fakes.Agents):
    """Records which pod IPs were asked (and so given the agent token)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        self.asked += pod_ips
        return [agent_client.AgentState(state="ready", weight_version=1, served_address=f"{ip}:8000") for ip in pod_ips]

    async def close(self) -> None:
        pass


def tiny(**spec: Any) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"].update(namespace="rl", uid="uid-tiny")
    manifest["spec"].update(replicas=1, **spec)
    return manifest


def foreign(kind: str, name: str, **fields: Any) -> dict[str, Any]:
    metadata = {"name": name, "namespace": "rl", "labels": {"megafleet.dev/fleet": "tiny", "megafleet.dev/shard": "0"}}
    return {"apiVersion": "v1", "kind": kind, "metadata": metadata, **fields}


def reconciled(api: kube_fakes.Api, agents: Agents | None = None) -> dict[str, Any]:
    runtime = context.Runtime.of(api, agents or Agents(), settings.OperatorSettings())

    async def once() -> dict[str, Any]:
        await reconcile.reconcile(runtime, await api.get("MegatronGeneration", "tiny", "rl") or {})
        return await api.get("MegatronGeneration", "tiny", "rl") or {}

    return asyncio.run(once())


def condition(fleet: dict[str, Any], kind: str) -> dict[str, Any]:
    return conditions.find(fleet.get("status", {}).get("conditions", []), kind) or {}


def test_a_service_squatting_on_a_frontend_name_is_reported_never_published() -> None:
    squatter = foreign("Service", "tiny-f0", spec={"clusterIP": "10.96.9.9", "ports": [{"port": 80}]})
    api = kube_fakes.Api(tiny(), NODE, squatter)

    fleet = reconciled(api)

    conflict = condition(fleet, "NameConflict")
    assert conflict["status"] == "True" and "Service 'tiny-f0'" in conflict["message"]
    assert condition(fleet, "Ready")["reason"] == "NameConflict"
    assert "10.96.9.9" not in str(fleet["status"].get("endpoints")) and "endpoints" not in fleet["status"]
    assert not [key for key in api.objects if key[0] in ("Pod", "ConfigMap")]
    assert api.objects[("Service", "rl", "tiny-f0")]["spec"] == squatter["spec"]  # untouched


def test_a_secret_squatting_on_the_token_name_is_reported_not_read() -> None:
    squatter = foreign("Secret", "tiny-agent-token", data={"other": "eA=="})
    api = kube_fakes.Api(tiny(), NODE, squatter)

    fleet = reconciled(api)  # it used to crash with KeyError 'token', at every retry

    assert "Secret 'tiny-agent-token'" in condition(fleet, "NameConflict")["message"]
    assert not [key for key in api.objects if key[0] in ("Pod", "Service")]


def test_a_conflict_clears_once_the_squatter_is_gone() -> None:
    api = kube_fakes.Api(tiny(), NODE, foreign("Secret", "tiny-agent-token", data={}))
    assert condition(reconciled(api), "NameConflict")["status"] == "True"
    del api.objects[("Secret", "rl", "tiny-agent-token")]

    fleet = reconciled(api)

    assert condition(fleet, "NameConflict")["status"] == "False"
    assert [endpoint["service"] for endpoint in fleet["status"]["endpoints"]] == ["tiny-f0"]


def test_a_pod_wearing_the_fleets_labels_is_neither_a_shard_nor_given_the_token() -> None:
    impostor = foreign("Pod", "impostor", spec={}, status={"phase": "Running", "podIP": "127.0.0.99"})
    api = kube_fakes.Api(tiny(), NODE, impostor)
    agents = Agents()

    reconciled(api, agents)
    api.run_pods("n0")
    fleet = reconciled(api, agents)

    assert "127.0.0.99" not in agents.asked
    assert fleet["status"]["shards"][0]["pods"] == ["tiny-s0-p0"]
    assert ("Pod", "rl", "impostor") in api.objects


def test_an_api_key_naming_a_fleets_agent_token_is_an_invalid_spec() -> None:
    other_token = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "other-agent-token",
            "namespace": "rl",
            "labels": {"megafleet.dev/component": "agent-token"},
            "ownerReferences": [{"kind": "MegatronGeneration", "name": "other", "uid": "u2", "controller": True}],
        },
        "data": {"api-key": "eA==", "token": "eA=="},
    }
    for name in ("other-agent-token", "tiny-agent-token"):
        api = kube_fakes.Api(tiny(frontend={"apiKeySecret": {"name": name}}), NODE, other_token)

        fleet = reconciled(api)

        invalid = condition(fleet, "InvalidSpec")
        assert invalid["status"] == "True" and "agent token" in invalid["message"], name
        assert not [key for key in api.objects if key[0] in ("Pod", "Service")]


def test_the_fleets_own_token_secret_emptied_by_hand_gets_a_new_token() -> None:
    api = kube_fakes.Api(tiny(), NODE)
    reconciled(api)
    api.objects[("Secret", "rl", "tiny-agent-token")]["data"] = {}

    fleet = reconciled(api)

    assert condition(fleet, "NameConflict")["status"] == "False"
    assert api.objects[("Secret", "rl", "tiny-agent-token")]["data"]["token"]


def driver_token(api: kube_fakes.Api) -> str:
    """The agent token as the Refit and RefitSession controllers read it."""

    async def read() -> str:
        real = cast(kube.Api, api)  # the fake has the methods the two calls use
        fleet = await validate.fleet(real, await api.get("MegatronGeneration", "tiny", "rl") or {}, context.ignore)
        assert fleet is not None
        return await token.read(real, fleet)

    return asyncio.run(read())


def test_the_refit_controllers_read_only_the_fleets_own_token_secret() -> None:
    squatted = kube_fakes.Api(
        tiny(), foreign("Secret", names.agent_secret("tiny"), data={names.AGENT_TOKEN_KEY: "c3RvbGVu"})
    )
    assert driver_token(squatted) == ""  # "stolen" is never sent to an agent
    owned = kube_fakes.Api(tiny())
    reconciled(owned)  # the operator creates the fleet's own Secret
    assert len(driver_token(owned)) >= 32
