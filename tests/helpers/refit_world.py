"""In-memory worlds for the Refit and RefitSession controllers' tests (:mod:`megafleet.refits`).

:func:`refit` builds a Refit object; :class:`World` is a fleet of two one-rank shards with running
pods in the in-memory API (:mod:`helpers.kube_fakes`), its RefitSessions and Refits, and
:class:`Agents` that play the members' side of a trainer's world; :class:`NoAgents` fails a test on
any agent call (a refused Refit reaches no agent).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import gzip
import hashlib
import json
from pathlib import Path
from typing import Any, cast

import yaml

from helpers import kube_fakes
from megafleet import agent_client, conditions, kube, reconcile
from megafleet import settings as operator_settings
from megafleet.objects import Object
from megafleet.reconcile import context
from megafleet.refits import refit_controller, session_controller
from megafleet_protocol import agent_api, vocabulary

ROOT = Path(__file__).resolve().parents[2]
NS = "rl"
CREATED = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
INFO = [["model.embed_tokens.weight", [32, 8], "torch.float32"], ["lm_head.weight", [32, 8], "torch.float32"]]
T = "2026-01-01T00:00:"
"""The start of a creation timestamp (add the seconds and ``Z``)."""


def refit(name: str, version: int, phase: str | None, created: str, fleet: str = "tiny") -> Object:
    """A rendezvous Refit of ``fleet`` in namespace rl (``phase`` None: never advanced)."""
    body: Object = {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "Refit",
        "metadata": {"name": name, "namespace": "rl", "creationTimestamp": created, "generation": 1},
        "spec": {
            "fleetRef": {"name": fleet},
            "version": version,
            "source": {"rendezvous": {"address": "10.0.0.1", "port": 29600}},
        },
    }
    if phase is not None:
        body["status"] = {"phase": phase}
    return body


class Agents:
    """The members' agents: every engine Ready; a join is ``joining`` until :meth:`settle` decides it."""

    def __init__(self) -> None:
        self.worlds: dict[str, agent_api.NemoWorldStatus | None] = {}
        self.joins: list[tuple[str, agent_api.NemoJoinRequest | agent_api.MegatronJoinRequest]] = []
        self.stage_joins: list[tuple[str, agent_api.NemoReshardJoinRequest]] = []  # NeMo's reshard stages
        self.leaves: list[tuple[str, str]] = []
        self.starts: list[tuple[str, agent_api.RefitRequest]] = []
        self.aborts: list[str] = []
        self.refuse_join: dict[str, str] = {}
        self.refuse_refit: dict[str, str] = {}  # what a refit start answers, by pod IP (default: accepted)
        self.refit_phase: dict[str, str] = {}  # what a started refit reports, by pod IP (default succeeded)
        self.versions: dict[str, int] = {}
        self.engine_state: vocabulary.EngineState = "ready"
        self.protocol = "nemo"  # the session's, which every leave must name
        self.capabilities: dict[str, agent_api.Capabilities] = {}  # GET /v1/state's, by pod IP (default: none)
        self.reports: dict[str, dict[str, Any]] = {}  # more fields of a refit's status, by pod IP
        self.commits: list[tuple[str, int]] = []  # POST /v1/refit/commit calls: pod IP, version
        self.after_commit: dict[str, str] = {}  # the phase a committed pod reports, by IP (default succeeded)

    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [
            agent_client.AgentState(
                state=self.engine_state,
                weight_version=0,
                capabilities=self.capabilities.get(ip, agent_api.Capabilities()),
            )
            for ip in pod_ips
        ]

    async def join(
        self,
        pod_ip: str,
        token: str,
        body: agent_api.NemoJoinRequest | agent_api.MegatronJoinRequest | agent_api.NemoReshardJoinRequest,
    ) -> str | None:
        if isinstance(body, agent_api.NemoReshardJoinRequest):
            return self._join_stages(pod_ip, body)
        self.joins.append((pod_ip, body))
        if pod_ip in self.refuse_join:
            return self.refuse_join[pod_ip]
        rank = body.rendezvous.rank_offset
        self.worlds[pod_ip] = agent_api.NemoWorldStatus(session=body.session, phase="joining", rank=rank)
        return None

    def settle(
        self, phase: str = "joined", *, error: str | None = None, only: str | None = None, **fields: Any
    ) -> None:
        for ip, world in self.worlds.items():
            if world is not None and only in (None, ip):
                self.worlds[ip] = world.model_copy(update={"phase": phase, "error": error, **fields})

    def _join_stages(self, pod_ip: str, body: agent_api.NemoReshardJoinRequest) -> str | None:
        """The stages' join: ``joining`` beside the pod's NeMo world until :meth:`settle_stages`."""
        self.stage_joins.append((pod_ip, body))
        if pod_ip in self.refuse_join:
            return self.refuse_join[pod_ip]
        world = self.worlds.get(pod_ip)
        assert world is not None and world.session == body.session, "NeMo's world is joined first"
        stages = agent_api.NemoReshardStatus(phase="joining", stages=len(body.stages), rank=body.rank_offset)
        self.worlds[pod_ip] = world.model_copy(update={"reshard": stages})
        return None

    def settle_stages(self, phase: str = "joined", *, error: str | None = None, only: str | None = None) -> None:
        for ip, world in self.worlds.items():
            if world is not None and world.reshard is not None and only in (None, ip):
                stages = world.reshard.model_copy(update={"phase": phase, "error": error})
                self.worlds[ip] = world.model_copy(update={"reshard": stages})

    async def leave(self, pod_ip: str, token: str, session: str, *, protocol: str) -> None:
        assert protocol == self.protocol, protocol
        self.leaves.append((pod_ip, session))
        world = self.worlds.get(pod_ip)
        if world is not None and world.session == session:
            self.worlds[pod_ip] = world.model_copy(update={"phase": "left"})

    async def refit_start(self, pod_ip: str, token: str, body: agent_api.RefitRequest) -> str | None:
        self.starts.append((pod_ip, body))
        self.versions[pod_ip] = body.version
        return self.refuse_refit.get(pod_ip)

    async def refit_abort(self, pod_ip: str, token: str, reason: str) -> None:
        self.aborts.append(pod_ip)

    async def refit_commit(self, pod_ip: str, token: str, version: int) -> str | None:
        self.commits.append((pod_ip, version))
        self.refit_phase[pod_ip] = self.after_commit.get(pod_ip, "succeeded")
        return None

    async def refit_status(self, pod_ip: str, token: str) -> agent_api.RefitStatusResponse | None:
        version = self.versions.get(pod_ip)
        phase = self.refit_phase.get(pod_ip, "succeeded") if version is not None else "idle"
        answer: dict[str, Any] = {
            "phase": phase,
            "version": version,
            "source": "nemo" if version is not None else None,
            "transport": None,
            "rank": None,
            "world_size": None,
            "phases": [agent_api.PhaseTiming(name="receive", milliseconds=5)],
            "duration_milliseconds": 7,
            "bytes_received": 0,
            "buckets": 0,
            "tensors_written": 0,
            "error": "bucket 2 of 3 not received" if phase == "failed" else None,
            "timed_out": False,
            "dirty": False,
            "state": "ready",
            "weight_version": version if phase == "succeeded" else 0,
            "world": self.worlds.get(pod_ip),
        }
        return agent_api.RefitStatusResponse(
            **{**answer, **(self.reports.get(pod_ip, {}) if version is not None else {})}
        )

    async def close(self) -> None:
        pass


class World:
    """A fleet of two one-rank shards with running pods, in the fake API, and its session."""

    def __init__(self, **fleet_spec: Any) -> None:
        manifest = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
        manifest["metadata"].update(namespace=NS, uid="fleet-uid")
        manifest["spec"].update(fleet_spec)
        node = {
            "kind": "Node",
            "metadata": {"name": "n0", "labels": {}},
            "spec": {},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}},
        }
        self.api = kube_fakes.Api(manifest, node)
        self.agents = Agents()
        self.settings = operator_settings.OperatorSettings()
        self.runtime = context.Runtime.of(
            cast(kube.Api, self.api), cast(agent_client.AgentClient, self.agents), self.settings
        )
        self.now = CREATED + datetime.timedelta(seconds=1)
        self.clock = 0.0

    def reconcile(self) -> None:
        body = asyncio.run(self.api.get("MegatronGeneration", "tiny", NS)) or {}
        asyncio.run(reconcile.reconcile(self.runtime, body))

    def start(self) -> None:
        """The fleet's first reconcile and its pods running."""
        self.reconcile()
        self.api.run_pods("n0")

    def pod_ips(self) -> dict[str, str]:
        return {name: obj["status"]["podIP"] for (kind, _, name), obj in self.api.objects.items() if kind == "Pod"}

    def session(self, name: str = "grpo", *, world_size: int = 4, trainer: int = 2, **spec: Any) -> None:
        body: Object = {
            "apiVersion": "megafleet.dev/v1alpha1",
            "kind": "RefitSession",
            "metadata": {
                "name": name,
                "namespace": NS,
                "uid": f"{name}-uid",
                "creationTimestamp": CREATED.strftime("%Y-%m-%dT%H:%M:%SZ"),
            },
            "spec": {
                "fleetRef": {"name": "tiny"},
                "nemoCollective": {
                    "address": "127.0.9.3",
                    "port": 29700,
                    "worldSize": world_size,
                    "trainerWorldSize": trainer,
                    "bucketBytes": 4096,
                },
                "joinTimeoutSeconds": 60,
                **spec,
            },
        }
        if "megatronNative" in spec:
            del body["spec"]["nemoCollective"]
        self.api.objects[("RefitSession", NS, name)] = body

    def refit_info(self, name: str = "grpo", *, entries: list[Any] = INFO, sha256: str | None = None) -> None:
        packed = gzip.compress(json.dumps(entries).encode())
        self.api.objects[("ConfigMap", NS, f"{name}-info")] = {
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-info", "namespace": NS},
            "binaryData": {"refitInfo.json.gz": base64.b64encode(packed).decode()},
        }
        body = self.api.objects[("RefitSession", NS, name)]
        body["spec"]["refitInfo"] = {
            "configMapRef": {"name": f"{name}-info", "key": "refitInfo.json.gz"},
            "sha256": sha256 or hashlib.sha256(packed).hexdigest(),
            "tensors": len(INFO),
        }

    def reshard(self, name: str = "grpo", *, stages: int = 2, info: Object | None = None) -> None:
        """NeMo's ``init_nccl_reshard_comm_group`` on the session (``stages`` stages sharing the
        trainer's ranks), and its ``prepare_nccl_reshard_refit_info`` when ``info`` is given."""
        body = self.api.objects[("RefitSession", NS, name)]
        world = body["spec"]["nemoCollective"]
        per_stage = world["trainerWorldSize"] // stages
        body["spec"]["nemoReshard"] = {
            "stages": [{"address": f"127.0.9.{3 + stage}", "port": 29800 + stage} for stage in range(stages)],
            "trainerRanksPerStage": per_stage,
            "subWorldSize": per_stage + world["worldSize"] - world["trainerWorldSize"],
        }
        if info is not None:
            packed = gzip.compress(json.dumps(info).encode())
            self.api.objects[("ConfigMap", NS, f"{name}-reshard-info")] = {
                "kind": "ConfigMap",
                "metadata": {"name": f"{name}-reshard-info", "namespace": NS},
                "binaryData": {"reshardInfo.json.gz": base64.b64encode(packed).decode()},
            }
            tensors = sum(len(entries) for entries in info["per_layer_params"].values()) + len(info["misc_meta"])
            body["spec"]["nemoReshard"]["refitInfo"] = {
                "configMapRef": {"name": f"{name}-reshard-info", "key": "reshardInfo.json.gz"},
                "sha256": hashlib.sha256(packed).hexdigest(),
                "tensors": tensors,
            }

    def advance(self, name: str = "grpo") -> Object:
        body = self.api.objects[("RefitSession", NS, name)]
        asyncio.run(session_controller.advance(self.runtime, body, now=lambda: self.now, clock=lambda: self.clock))
        return self.api.objects[("RefitSession", NS, name)]

    def joined(self, name: str = "grpo") -> Object:
        self.advance(name)
        self.agents.settle("joined", generation="nemo", store_reachable=True)
        found = self.advance(name)
        assert found["status"]["phase"] == "Joined", found["status"]
        return found

    def fleet(self) -> Object:
        return self.api.objects[("MegatronGeneration", NS, "tiny")]

    def refit(self, version: int, source: Object, name: str | None = None) -> Object:
        name = name or f"tiny-v{version}"
        body = {
            "apiVersion": "megafleet.dev/v1alpha1",
            "kind": "Refit",
            "metadata": {"name": name, "namespace": NS, "creationTimestamp": "2026-01-01T00:01:00Z"},
            "spec": {"fleetRef": {"name": "tiny"}, "version": version, "source": source},
        }
        self.api.objects[("Refit", NS, name)] = body
        return body

    def advance_refit(self, name: str) -> Object:
        """One step of the Refit, with the agents the world has now (a test may swap them after the
        session joined)."""
        body = self.api.objects[("Refit", NS, name)]
        runtime = dataclasses.replace(self.runtime, agents=cast(agent_client.AgentClient, self.agents))
        asyncio.run(refit_controller.advance(runtime, body))
        return self.api.objects[("Refit", NS, name)]


def tiny_fleet() -> Object:
    """The tiny CPU example fleet in namespace rl (uid uid-1), with no status."""
    fleet: Object = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    fleet["metadata"].update(namespace="rl", uid="uid-1")
    return fleet


def condition(obj: Object, kind: str) -> Object:
    found = conditions.find(obj.get("status", {}).get("conditions", []), kind)
    assert found is not None, (kind, obj.get("status"))
    return found


class NoAgents:
    """An agent client that fails the test on any call: a refused Refit reaches no agent."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the controller called the agents ({name}) for a refused Refit")
