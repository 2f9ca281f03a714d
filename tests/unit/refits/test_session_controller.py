"""The RefitSession controller against an in-memory API (:mod:`helpers.kube_fakes`) and fake agents
that play the members' side of a trainer's world (:mod:`helpers.refit_world`): the checks
(WorldSizeMismatch, BackendNotSupported), the join (NotReady at the deadline, JoinFailed with every
member told to leave), the hold (one session per fleet, scale, roll and place waiting while heal
runs), and the losses (MemberLost, TrainerGone, RefitInfoRejected)."""

from __future__ import annotations

import asyncio
import datetime
from typing import cast

import pytest

from helpers.refit_world import CREATED, NS, World, condition
from megafleet import conditions
from megafleet import settings as operator_settings
from megafleet.refits import session_end, session_status, session_view
from megafleet_protocol import agent_api, vocabulary

# -- checks ----------------------------------------------------------------------------------------


def test_a_world_the_fleet_cannot_field_fails_naming_both_numbers_and_holds_nothing(world: World) -> None:
    world.session(world_size=5, trainer=2)

    status = world.advance()["status"]

    assert status["phase"] == "Failed"
    joined = condition(world.api.objects[("RefitSession", NS, "grpo")], session_status.JOINED)
    assert (joined["status"], joined["reason"]) == ("False", session_status.WORLD_SIZE_MISMATCH)
    assert "inference world is 3 ranks (worldSize 5 - trainerWorldSize 2)" in status["message"]
    assert "fleet tiny has 2 shards x 1 ranks = 2" in status["message"]
    assert world.agents.joins == [] and not (world.fleet()["status"].get("refit") or {}).get("session")


def test_megatron_native_needs_the_megatron_backend(world: World) -> None:
    native = {"address": "127.0.9.3", "port": 29700, "worldSize": 4, "trainerWorldSize": 2}
    world.session(megatronNative=native)

    status = world.advance()["status"]

    assert status["phase"] == "Failed" and "needs engine.backend megatron" in status["message"]
    assert "runs transformers" in status["message"]
    found = condition(world.api.objects[("RefitSession", NS, "grpo")], session_status.JOINED)
    assert found["reason"] == session_status.BACKEND_NOT_SUPPORTED
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
    assert condition(world.api.objects[("RefitSession", NS, "grpo")], session_status.JOINED)["reason"] == "NotReady"
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
    assert condition(session, session_status.JOINED)["status"] == "True"
    accepted = condition(session, session_status.REFIT_INFO_ACCEPTED)
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
    found = condition(session, session_status.JOINED)
    assert found["reason"] == session_status.JOIN_FAILED and "shard 1, pod tiny-s1-p0" in found["message"]
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
    broken = condition(session, session_status.BROKEN)
    assert status["phase"] == "Broken" and broken["reason"] == session_status.MEMBER_LOST
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
    found = condition(world.api.objects[("RefitSession", NS, "grpo")], session_status.JOINED)
    assert found["reason"] == session_status.TRAINER_GONE
    assert len(world.agents.leaves) == 2 and world.fleet()["status"]["refit"].get("session") is None


def test_a_refit_info_that_does_not_match_its_sha256_breaks_the_session(world: World) -> None:
    world.session()
    world.refit_info(sha256="0" * 64)
    world.joined()

    status = world.advance()["status"]

    broken = condition(world.api.objects[("RefitSession", NS, "grpo")], session_status.BROKEN)
    assert status["phase"] == "Broken" and broken["reason"] == session_status.REFIT_INFO_REJECTED
    assert "sha256" in broken["message"] and "is not refitInfo.sha256 000000" in broken["message"]


def test_deleting_a_session_makes_its_members_leave_and_releases_the_hold(world: World) -> None:
    world.session()
    session = world.joined()

    asyncio.run(session_end.release(world.runtime.api, world.runtime.agents, session_view.Session.parse(session)))

    assert sorted(world.agents.leaves) == sorted((ip, "grpo-uid") for ip in world.pod_ips().values())
    assert world.fleet()["status"]["refit"].get("session") is None


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


# -- the trainer's membership (NeMo's set_refit_membership, a rebuild over the live shards) ---------


def test_a_session_over_the_trainers_surviving_shards_packs_them_and_ignores_the_lost_one() -> None:
    world = World(replicas=3)
    world.start()
    del world.api.objects[("Pod", NS, "tiny-s1-p0")]  # shard 1 was lost; it heals outside the world
    world.session(world_size=4, trainer=2, shards=[2, 0])

    joining = world.advance()["status"]

    assert joining["phase"] == "Joining", joining
    assert joining["membership"]["rankOffsets"] == [{"shard": 0, "offset": 2}, {"shard": 2, "offset": 3}]
    ips = world.pod_ips()
    assert [(ip, body.rendezvous.rank_offset) for ip, body in world.agents.joins] == [
        (ips["tiny-s0-p0"], 2),
        (ips["tiny-s2-p0"], 3),
    ]
    assert joining["message"].startswith("2 shards join")


def test_a_membership_the_fleet_cannot_field_fails_naming_the_member_shards() -> None:
    world = World(replicas=3)
    world.start()
    world.session(world_size=5, trainer=2, shards=[0, 2])
    status = world.advance()["status"]
    assert status["phase"] == "Failed" and "fleet tiny has 2 member shards x 1 ranks = 2" in status["message"]

    outside = World(replicas=2)
    outside.start()
    outside.session(world_size=4, trainer=2, shards=[0, 2])
    status = outside.advance()["status"]
    assert status["phase"] == "Failed" and "membership names shards [2], but fleet tiny has 2" in status["message"]
