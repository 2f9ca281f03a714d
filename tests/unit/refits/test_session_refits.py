"""Refits through a RefitSession against an in-memory API and fake members
(:mod:`helpers.refit_world`): each makes exactly one attempt with the session's membership and refit
info, a failed one breaks the session, one through a session that is not joined fails without an
agent call, rendezvous and checkpoint Refits of a held fleet are refused (SessionHeld), and the
members above a held scale-down still receive them."""

from __future__ import annotations

from typing import Any, cast

import pytest

from helpers.refit_world import INFO, NS, NoAgents, World, condition
from megafleet import conditions
from megafleet.objects import Object
from megafleet.refits import refit_status, session_status
from megafleet_protocol import agent_api

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
    broken = condition(session, session_status.BROKEN)
    assert session["status"]["phase"] == "Broken" and broken["reason"] == session_status.REFIT_FAILED
    assert "Refit tiny-v1 (version 1) failed" in broken["message"]
    assert sorted(world.agents.leaves) == sorted((ip, "grpo-uid") for ip in ips.values())
    refit = world.fleet()["status"]["refit"]
    assert (refit.get("session"), refit.get("active")) == (None, None)


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
    assert condition(world.api.objects[("Refit", NS, "tiny-v1")], "Failed")["reason"] == refit_status.SESSION_HELD


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
    assert condition(world.fleet(), conditions.REFIT_SESSION_HELD)["message"] == (
        "RefitSession grpo holds the fleet: spec.replicas 1: shard 1 leaves at the trainer's next rebuild "
        "(its world still names it)"
    )

    world.refit(1, {"session": {"name": "grpo"}})
    world.advance_refit("tiny-v1")
    done = world.advance_refit("tiny-v1")["status"]

    assert done["phase"] == "Succeeded", done
    assert sorted(ip for ip, _ in world.agents.starts) == sorted(world.pod_ips().values())
