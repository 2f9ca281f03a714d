"""The RefitSession driver and the Refits through a session (issue 13 point 7), against an in-memory
API (:mod:`helpers.kube_fakes`) and fake agents that play the members' side of a trainer's world:
the checks (WorldSizeMismatch, BackendNotSupported), the join (NotReady at the deadline, JoinFailed
with every member told to leave), the hold (one session per fleet, rendezvous and checkpoint Refits
refused, scale, roll and place waiting while heal runs), the losses (MemberLost, RefitFailed,
TrainerGone, RefitInfoRejected) and a session Refit's single attempt."""

from __future__ import annotations

import asyncio
import base64
import datetime
import gzip
import hashlib
import json
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from helpers import kube_fakes
from megafleet import agent_client, conditions, kube, reconcile, refit_driver, session_driver
from megafleet import settings as operator_settings
from megafleet.objects import Object
from megafleet.reconcile import context
from megafleet_protocol import agent_api, vocabulary

ROOT = Path(__file__).resolve().parents[2]
NS = "rl"
CREATED = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
INFO = [["model.embed_tokens.weight", [32, 8], "torch.float32"], ["lm_head.weight", [32, 8], "torch.float32"]]


class Agents:
    """The members' agents: every engine Ready; a join is ``joining`` until :meth:`settle` decides it."""

    def __init__(self) -> None:
        self.worlds: dict[str, agent_api.NemoWorldStatus | None] = {}
        self.joins: list[tuple[str, agent_api.NemoJoinRequest | agent_api.MegatronJoinRequest]] = []
        self.leaves: list[tuple[str, str]] = []
        self.starts: list[tuple[str, agent_api.RefitRequest]] = []
        self.aborts: list[str] = []
        self.refuse_join: dict[str, str] = {}
        self.refit_phase: dict[str, str] = {}  # what a started refit reports, by pod IP (default succeeded)
        self.versions: dict[str, int] = {}
        self.engine_state: vocabulary.EngineState = "ready"
        self.protocol = "nemo"  # the session's, which every leave must name

    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [agent_client.AgentState(state=self.engine_state, weight_version=0) for _ in pod_ips]

    async def join(
        self, pod_ip: str, token: str, body: agent_api.NemoJoinRequest | agent_api.MegatronJoinRequest
    ) -> str | None:
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

    async def leave(self, pod_ip: str, token: str, session: str, *, protocol: str) -> None:
        assert protocol == self.protocol, protocol
        self.leaves.append((pod_ip, session))
        world = self.worlds.get(pod_ip)
        if world is not None and world.session == session:
            self.worlds[pod_ip] = world.model_copy(update={"phase": "left"})

    async def refit_start(self, pod_ip: str, token: str, body: agent_api.RefitRequest) -> str | None:
        self.starts.append((pod_ip, body))
        self.versions[pod_ip] = body.version
        return None

    async def refit_abort(self, pod_ip: str, token: str, reason: str) -> None:
        self.aborts.append(pod_ip)

    async def refit_status(self, pod_ip: str, token: str) -> agent_api.RefitStatusResponse | None:
        version = self.versions.get(pod_ip)
        phase = self.refit_phase.get(pod_ip, "succeeded") if version is not None else "idle"
        return agent_api.RefitStatusResponse(
            phase=phase,
            version=version,
            source="nemo" if version is not None else None,
            transport=None,
            rank=None,
            world_size=None,
            phases=[agent_api.PhaseTiming(name="receive", milliseconds=5)],
            duration_milliseconds=7,
            bytes_received=0,
            buckets=0,
            tensors_written=0,
            error="bucket 2 of 3 not received" if phase == "failed" else None,
            timed_out=False,
            dirty=False,
            state="ready",
            weight_version=version if phase == "succeeded" else 0,
            world=self.worlds.get(pod_ip),
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

    def advance(self, name: str = "grpo") -> Object:
        body = self.api.objects[("RefitSession", NS, name)]
        asyncio.run(session_driver.advance(self.runtime, body, now=lambda: self.now, clock=lambda: self.clock))
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
        body = self.api.objects[("Refit", NS, name)]
        asyncio.run(
            refit_driver.advance(
                cast(kube.Api, self.api),
                cast(agent_client.AgentClient, self.agents),
                body,
                settings=self.settings.refit,
            )
        )
        return self.api.objects[("Refit", NS, name)]


def condition(obj: Object, kind: str) -> Object:
    found = conditions.find(obj.get("status", {}).get("conditions", []), kind)
    assert found is not None, (kind, obj.get("status"))
    return found


@pytest.fixture
def world() -> World:
    found = World()
    found.start()
    return found


# -- checks ----------------------------------------------------------------------------------------


def test_a_world_the_fleet_cannot_field_fails_naming_both_numbers_and_holds_nothing(world: World) -> None:
    world.session(world_size=5, trainer=2)

    status = world.advance()["status"]

    assert status["phase"] == "Failed"
    joined = condition(world.api.objects[("RefitSession", NS, "grpo")], session_driver.JOINED)
    assert (joined["status"], joined["reason"]) == ("False", session_driver.WORLD_SIZE_MISMATCH)
    assert "inference world is 3 ranks (worldSize 5 - trainerWorldSize 2)" in status["message"]
    assert "fleet tiny has 2 shards x 1 ranks = 2" in status["message"]
    assert world.agents.joins == [] and not (world.fleet()["status"].get("refit") or {}).get("session")


def test_megatron_native_needs_the_megatron_backend(world: World) -> None:
    native = {"address": "127.0.9.3", "port": 29700, "worldSize": 4, "trainerWorldSize": 2}
    world.session(megatronNative=native)

    status = world.advance()["status"]

    assert status["phase"] == "Failed" and "needs engine.backend megatron" in status["message"]
    assert "runs transformers" in status["message"]
    found = condition(world.api.objects[("RefitSession", NS, "grpo")], session_driver.JOINED)
    assert found["reason"] == session_driver.BACKEND_NOT_SUPPORTED
    assert world.agents.joins == []


def test_a_session_of_a_missing_fleet_waits_pending() -> None:
    world = World()
    del world.api.objects[("MegatronGeneration", NS, "tiny")]
    world.session()

    status = world.advance()["status"]

    assert (status["phase"], status["message"]) == ("Pending", "fleet tiny does not exist")


def test_shards_not_running_by_the_join_deadline_fail_the_session_not_ready() -> None:
    world = World()
    world.reconcile()  # pods created, never running
    world.session()

    waiting = world.advance()["status"]
    assert waiting["phase"] == "Pending" and waiting["message"] == "waiting for shard 0's pods to run"
    world.advance()
    assert world.api.writes["status RefitSession"] == 1, "waiting again writes nothing"
    world.now = CREATED + datetime.timedelta(seconds=61)
    failed = world.advance()["status"]

    assert failed["phase"] == "Failed"
    assert failed["message"] == "waiting for shard 0's pods to run for joinTimeoutSeconds 60"
    assert condition(world.api.objects[("RefitSession", NS, "grpo")], session_driver.JOINED)["reason"] == "NotReady"
    assert world.agents.joins == [] and not (world.fleet()["status"].get("refit") or {}).get("session")


# -- join ------------------------------------------------------------------------------------------


def test_a_session_takes_the_hold_publishes_the_membership_once_and_joins_every_member(world: World) -> None:
    world.session()
    world.refit_info()

    joining = world.advance()["status"]

    assert joining["phase"] == "Joining"
    assert joining["membership"] == {
        "worldSize": 4,
        "trainerWorldSize": 2,
        "rankOffsets": [{"shard": 0, "offset": 2}, {"shard": 1, "offset": 3}],
    }
    fleet = world.fleet()
    assert fleet["status"]["refit"]["session"] == "grpo"
    held = condition(fleet, conditions.REFIT_SESSION_HELD)
    assert held["status"] == "True" and "until RefitSession grpo ends" in held["message"]
    ips = world.pod_ips()
    assert [(ip, body.rendezvous.rank_offset) for ip, body in world.agents.joins] == [
        (ips["tiny-s0-p0"], 2),
        (ips["tiny-s1-p0"], 3),
    ]
    body = world.agents.joins[0][1]
    assert isinstance(body, agent_api.NemoJoinRequest)
    assert (body.session, body.rendezvous.address, body.rendezvous.port) == ("grpo-uid", "127.0.9.3", 29700)
    assert (body.rendezvous.world_size, body.rendezvous.trainer_world_size) == (4, 2)
    assert world.advance()["status"]["phase"] == "Joining", "not joined before every member reports it"

    world.agents.settle("joined", generation="nemo", store_reachable=True)
    joined = world.advance()
    world.advance()  # the refit info is checked in the Joined phase

    session = world.api.objects[("RefitSession", NS, "grpo")]
    assert (joined["status"]["phase"], session["status"]["generation"]) == ("Joined", "nemo")
    assert condition(session, session_driver.JOINED)["status"] == "True"
    accepted = condition(session, session_driver.REFIT_INFO_ACCEPTED)
    assert accepted["status"] == "True" and accepted["message"].startswith("2 tensors")
    assert session["status"]["membership"] == joining["membership"], "never recomputed"
    assert len(world.agents.joins) == 2, "each member is asked once"


def test_a_second_session_of_the_fleet_waits_for_the_first(world: World) -> None:
    world.session("first")
    world.session("second")
    world.advance("first")

    status = world.advance("second")["status"]

    assert (status["phase"], status["message"]) == ("Pending", "waiting for RefitSession first")
    assert {body.session for _, body in world.agents.joins} == {"first-uid"}


@pytest.mark.parametrize("refused", [True, False], ids=["join-refused", "join-failed"])
def test_a_failed_join_makes_every_member_leave_and_releases_the_hold(world: World, refused: bool) -> None:
    ips = world.pod_ips()
    world.session()
    if refused:
        world.agents.refuse_join[ips["tiny-s1-p0"]] = "HTTP 409: a refit to weight version 3 is receiving"
        world.advance()
    else:
        world.advance()
        world.agents.settle("failed", error="the trainer's store timed out", only=ips["tiny-s1-p0"])
        world.advance()

    session = world.api.objects[("RefitSession", NS, "grpo")]
    assert session["status"]["phase"] == "Failed"
    found = condition(session, session_driver.JOINED)
    assert found["reason"] == session_driver.JOIN_FAILED and "shard 1, pod tiny-s1-p0" in found["message"]
    assert ("a refit to weight version 3" if refused else "the trainer's store timed out") in found["message"]
    assert sorted(world.agents.leaves) == sorted((ip, "grpo-uid") for ip in ips.values())
    assert world.fleet()["status"]["refit"].get("session") is None
    assert condition(world.fleet(), conditions.REFIT_SESSION_HELD)["status"] == "False"


def test_a_join_not_done_by_the_deadline_fails_and_every_member_leaves(world: World) -> None:
    world.session()
    world.advance()
    world.now = CREATED + datetime.timedelta(seconds=60 + world.settings.session.join_grace_seconds)

    status = world.advance()["status"]

    assert status["phase"] == "Failed" and "not joined within joinTimeoutSeconds 60" in status["message"]
    assert "tiny-s0-p0 is still joining" in status["message"]
    assert len(world.agents.leaves) == 2


# -- losses ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["pod-deleted", "left", "restarted"])
def test_a_lost_member_breaks_the_session_naming_shard_and_pod(world: World, loss: str) -> None:
    world.session()
    world.joined()
    ips = world.pod_ips()
    if loss == "pod-deleted":
        del world.api.objects[("Pod", NS, "tiny-s1-p0")]
    elif loss == "left":
        world.agents.settle("left", only=ips["tiny-s1-p0"])
    else:
        world.agents.worlds[ips["tiny-s1-p0"]] = None  # a new engine process knows no world

    status = world.advance()["status"]

    session = world.api.objects[("RefitSession", NS, "grpo")]
    broken = condition(session, session_driver.BROKEN)
    assert status["phase"] == "Broken" and broken["reason"] == session_driver.MEMBER_LOST
    assert "shard 1" in broken["message"]
    if loss != "pod-deleted":
        assert "pod tiny-s1-p0" in broken["message"]
    assert (ips["tiny-s0-p0"], "grpo-uid") in world.agents.leaves, "the survivor leaves"
    assert world.fleet()["status"]["refit"].get("session") is None


def test_a_trainer_whose_store_stays_unreachable_for_a_minute_closes_the_session(world: World) -> None:
    world.session()
    world.joined()
    world.agents.settle("joined", store_reachable=False)

    world.clock = 100.0
    assert world.advance()["status"]["phase"] == "Joined"
    world.clock = 159.0
    assert world.advance()["status"]["phase"] == "Joined"
    world.agents.settle("joined", store_reachable=True, only=world.pod_ips()["tiny-s0-p0"])
    world.clock = 170.0
    assert world.advance()["status"]["phase"] == "Joined", "one member reaching the store restarts the wait"
    world.agents.settle("joined", store_reachable=False)
    world.clock = 200.0
    world.advance()
    world.clock = 260.0
    status = world.advance()["status"]

    assert status["phase"] == "Closed" and "unreachable for 60 s" in status["message"]
    found = condition(world.api.objects[("RefitSession", NS, "grpo")], session_driver.JOINED)
    assert found["reason"] == session_driver.TRAINER_GONE
    assert len(world.agents.leaves) == 2 and world.fleet()["status"]["refit"].get("session") is None


def test_a_refit_info_that_does_not_match_its_sha256_breaks_the_session(world: World) -> None:
    world.session()
    world.refit_info(sha256="0" * 64)
    world.joined()

    status = world.advance()["status"]

    broken = condition(world.api.objects[("RefitSession", NS, "grpo")], session_driver.BROKEN)
    assert status["phase"] == "Broken" and broken["reason"] == session_driver.REFIT_INFO_REJECTED
    assert "sha256" in broken["message"] and "is not refitInfo.sha256 000000" in broken["message"]


def test_deleting_a_session_makes_its_members_leave_and_releases_the_hold(world: World) -> None:
    world.session()
    session = world.joined()

    asyncio.run(session_driver.release(world.runtime.api, world.runtime.agents, session_driver.Session.parse(session)))

    assert sorted(world.agents.leaves) == sorted((ip, "grpo-uid") for ip in world.pod_ips().values())
    assert world.fleet()["status"]["refit"].get("session") is None


# -- Refits through the session --------------------------------------------------------------------


def test_three_session_refits_each_make_one_attempt_with_the_sessions_membership_and_info(world: World) -> None:
    world.session()
    world.refit_info()
    world.joined()
    world.advance()  # refit info accepted
    for version in (1, 2, 3):
        name = f"tiny-v{version}"
        world.refit(version, {"session": {"name": "grpo"}})
        running = world.advance_refit(name)["status"]
        assert running["phase"] == "Running" and running["attempts"] == 1
        assert running["membership"]["rankOffsets"] == [{"shard": 0, "offset": 2}, {"shard": 1, "offset": 3}]
        done = world.advance_refit(name)["status"]
        assert done["phase"] == "Succeeded", done

    assert len(world.agents.starts) == 6 and world.agents.joins[2:] == [], "refits never join"
    body = world.agents.starts[-1][1]
    assert isinstance(body, agent_api.NemoRefitRequest) and body.rendezvous is None
    assert (body.version, body.session, body.bucket_bytes, body.generation) == (3, "grpo-uid", 4096, "nemo")
    assert [[t.name, t.shape, t.dtype] for t in body.refit_info] == INFO
    assert world.fleet()["status"]["refit"]["currentVersion"] == 3
    assert world.fleet()["status"]["refit"]["session"] == "grpo", "the hold stays"
    assert world.api.objects[("RefitSession", NS, "grpo")]["status"]["lastVersion"] == 3


def test_a_failed_session_refit_is_not_retried_and_breaks_the_session(world: World) -> None:
    world.session()
    world.refit_info()
    world.joined()
    ips = world.pod_ips()
    world.agents.refit_phase[ips["tiny-s1-p0"]] = "failed"
    world.refit(1, {"session": {"name": "grpo"}})
    world.advance_refit("tiny-v1")

    status = world.advance_refit("tiny-v1")["status"]

    assert status["phase"] == "Failed" and status["attempts"] == 1
    assert "bucket 2 of 3 not received" in status["message"]
    assert len(world.agents.starts) == 2, "exactly one attempt"
    session = world.api.objects[("RefitSession", NS, "grpo")]
    broken = condition(session, session_driver.BROKEN)
    assert session["status"]["phase"] == "Broken" and broken["reason"] == session_driver.REFIT_FAILED
    assert "Refit tiny-v1 (version 1) failed" in broken["message"]
    assert sorted(world.agents.leaves) == sorted((ip, "grpo-uid") for ip in ips.values())
    refit = world.fleet()["status"]["refit"]
    assert (refit.get("session"), refit.get("active")) == (None, None)


class NoAgents:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the driver called the agents ({name}) for a refused Refit")


def test_a_refit_through_a_session_that_is_not_joined_fails_without_an_agent_call(world: World) -> None:
    world.session()
    world.advance()  # Joining
    world.agents = cast(Any, NoAgents())
    world.refit(1, {"session": {"name": "grpo"}})

    status = world.advance_refit("tiny-v1")["status"]

    assert status["phase"] == "Failed" and "RefitSession grpo is Joining, not Joined" in status["message"]
    assert condition(world.api.objects[("Refit", NS, "tiny-v1")], "Failed")["reason"] == "SessionNotJoined"


@pytest.mark.parametrize(
    "source",
    [{"checkpoint": {"path": "/ckpt/7"}}, {"rendezvous": {"address": "10.0.0.1", "port": 29600}}],
    ids=["checkpoint", "rendezvous"],
)
def test_other_refits_of_a_held_fleet_are_refused_session_held(world: World, source: Object) -> None:
    world.session()
    world.joined()
    world.agents = cast(Any, NoAgents())
    world.refit(1, source)

    status = world.advance_refit("tiny-v1")["status"]

    assert status["phase"] == "Failed" and "held by RefitSession grpo" in status["message"]
    assert condition(world.api.objects[("Refit", NS, "tiny-v1")], "Failed")["reason"] == refit_driver.SESSION_HELD


# -- the hold in the fleet's reconcile -------------------------------------------------------------


def test_while_held_scaling_rolling_and_placing_wait_and_healing_runs(world: World) -> None:
    world.session()
    world.joined()
    fleet = world.fleet()
    fleet["spec"]["replicas"] = 3
    fleet["spec"]["engine"]["maxBatchSize"] = 4  # changes the pod template: a roll
    world.reconcile()

    pods = sorted(name for kind, _, name in world.api.objects if kind == "Pod")
    assert pods == ["tiny-s0-p0", "tiny-s1-p0"], "no shard placed, none rolled"
    held = condition(world.fleet(), conditions.REFIT_SESSION_HELD)
    assert held["message"] == "spec.replicas 3 and a pod template change wait until RefitSession grpo ends"

    world.api.objects[("Pod", NS, "tiny-s1-p0")]["status"]["phase"] = "Failed"
    world.reconcile()
    pods = sorted(name for kind, _, name in world.api.objects if kind == "Pod")
    assert pods == ["tiny-s0-p0"], "the broken shard is healed (removed), not placed again while held"

    world.advance()  # the session sees its member gone
    assert world.api.objects[("RefitSession", NS, "grpo")]["status"]["phase"] == "Broken"
    world.reconcile()
    pods = sorted(name for kind, _, name in world.api.objects if kind == "Pod")
    assert "tiny-s1-p0" in pods and "tiny-s2-p0" in pods, "released: healing and scaling run"
    assert condition(world.fleet(), conditions.REFIT_SESSION_HELD)["status"] == "False"


def test_a_hold_whose_session_is_gone_is_released_by_the_fleets_reconcile(world: World) -> None:
    world.session()
    world.joined()
    world.fleet()["spec"]["replicas"] = 3
    del world.api.objects[("RefitSession", NS, "grpo")]  # its finalizer removed by hand

    world.reconcile()

    assert world.fleet()["status"]["refit"].get("session") is None
    assert condition(world.fleet(), conditions.REFIT_SESSION_HELD)["status"] == "False"
    assert ("Pod", NS, "tiny-s2-p0") in world.api.objects, "the held scale is applied"


def test_a_megatron_native_session_joins_refits_and_leaves_through_the_megatron_routes() -> None:
    gpus = {"gpusPerNode": 1, "cpu": "1", "memory": "1Gi"}
    world = World(engine={"backend": "megatron", "maxBatchSize": 8}, resources=gpus)
    world.start()
    native = {"address": "127.0.9.3", "port": 29700, "worldSize": 4, "trainerWorldSize": 2, "copyBackend": "gloo"}
    world.session(megatronNative=native)
    world.agents.protocol = "megatron"
    world.joined()
    world.refit(1, {"session": {"name": "grpo"}})
    world.advance_refit("tiny-v1")
    del world.api.objects[("Pod", NS, "tiny-s1-p0")]

    failed = world.advance_refit("tiny-v1")["status"]  # the member is gone: the refit fails, the session breaks

    bodies = [body for _, body in world.agents.joins]
    assert len(bodies) == 2 and all(isinstance(body, agent_api.MegatronJoinRequest) for body in bodies)
    assert {body.copy_backend for body in bodies if isinstance(body, agent_api.MegatronJoinRequest)} == {"gloo"}
    started = world.agents.starts[0][1]
    assert isinstance(started, agent_api.MegatronRefitRequest) and started.session == "grpo-uid"
    assert failed["phase"] == "Failed" and "shard 1 left the fleet" in failed["message"]
    assert world.api.objects[("RefitSession", NS, "grpo")]["status"]["phase"] == "Broken"
    assert world.agents.leaves == [(world.pod_ips()["tiny-s0-p0"], "grpo-uid")], "left through the megatron route"


def test_a_scale_down_waits_while_held_and_the_shard_above_it_still_receives_session_refits(world: World) -> None:
    world.session()
    world.refit_info()
    world.joined()
    world.fleet()["spec"]["replicas"] = 1
    world.reconcile()
    assert ("Pod", NS, "tiny-s1-p0") in world.api.objects, "not drained while held"
    assert condition(world.fleet(), conditions.REFIT_SESSION_HELD)["message"].startswith("spec.replicas 1 waits")

    world.refit(1, {"session": {"name": "grpo"}})
    world.advance_refit("tiny-v1")
    done = world.advance_refit("tiny-v1")["status"]

    assert done["phase"] == "Succeeded", done
    assert sorted(ip for ip, _ in world.agents.starts) == sorted(world.pod_ips().values())


@pytest.mark.parametrize(("state", "phase"), [("loading", "Joining"), ("stale", "Joining"), ("failed", "Pending")])
def test_engines_without_weights_can_join_failed_ones_cannot(world: World, state: str, phase: str) -> None:
    world.agents.engine_state = cast(vocabulary.EngineState, state)
    world.session()

    status = world.advance()["status"]

    assert status["phase"] == phase, status
    if phase == "Pending":
        assert status["message"].startswith("waiting for shard 0: the engine of tiny-s0-p0 failed")
        assert world.agents.joins == []


def test_the_trainer_gone_bound_is_an_operator_setting_overridable_from_the_environment() -> None:
    name = operator_settings.env_name("session", "trainer_gone_seconds")
    assert name == "MEGAFLEET_SESSION_TRAINER_GONE_SECONDS"
    found = operator_settings.OperatorSettings.from_environ({name: "15", "MEGAFLEET_REFIT_MAX_ATTEMPTS": "3"})
    assert found.session.trainer_gone_seconds == 15.0 and found.refit.max_attempts == 3
    assert operator_settings.OperatorSettings.from_environ({}) == operator_settings.OperatorSettings()
    with pytest.raises(ValueError, match="MEGAFLEET_SESSION_TRAINER_GONE_SECONDS='soon'"):
        operator_settings.OperatorSettings.from_environ({name: "soon"})
