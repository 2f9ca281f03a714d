"""NeMo's M-to-N reshard in a RefitSession (``spec.nemoReshard``): the spec's rules, the reshard refit
info's check, the stages' join as pure verdicts, and the controllers against an in-memory API and fake
members (:mod:`helpers.refit_world`): the members join every stage communicator after the session
joined NeMo's world (each shard at its stage rank), ``ReshardJoined`` follows their reports, a failed
join fails the session, a member that loses its stages breaks it, and a Refit through the session goes
to the reshard route with NeMo's refit info only once the stages are joined."""

from __future__ import annotations

import base64
import datetime
import gzip
import hashlib
import json
from typing import Any

import pydantic
import pytest

from helpers.refit_world import NS, World, condition
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.refits import refit_info_check, refit_status, reshard_info_check, session_reshard, session_status
from megafleet_protocol import agent_api

UP = {
    "name": "model.layers.0.mlp.up_proj.weight",
    "global_shape": [8, 4],
    "dtype": "torch.bfloat16",
    "pp_stage": 0,
    "src_mesh_info": {"mesh": [0]},
    "src_placements": [{}],
    "dst_mesh_info": {"mesh": [1, 2]},
    "dst_placements": [{}],
}
RESHARD_INFO: Object = {
    "layer_names": ["model.layers.0", "model.layers.1"],
    "per_layer_params": {"model.layers.0": [UP], "model.layers.1": [dict(UP, name="model.layers.1.up", pp_stage=1)]},
    "misc_meta": {"model.norm.weight": {"shape": [4], "dtype": "torch.float32"}},
    "train_world_size": 2,
    "gen_world_size": 2,
    "pp_size": 2,
}
COLLECTIVE = {"address": "127.0.9.3", "port": 29700, "worldSize": 4, "trainerWorldSize": 2, "bucketBytes": 4096}
STAGES = [{"address": "127.0.9.3", "port": 29800}, {"address": "127.0.9.4", "port": 29801}]

# -- the spec ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reshard", "more", "problem"),
    [
        ({"stages": STAGES, "trainerRanksPerStage": 1, "subWorldSize": 3}, {}, None),
        ({"stages": STAGES[:1], "trainerRanksPerStage": 2, "subWorldSize": 4}, {}, None),
        ({"stages": STAGES, "trainerRanksPerStage": 1, "subWorldSize": 4}, {}, "subWorldSize 4 must be"),
        ({"stages": STAGES, "trainerRanksPerStage": 2, "subWorldSize": 4}, {}, "2 stages x trainerRanksPerStage 2"),
        (
            {"stages": STAGES, "trainerRanksPerStage": 1, "subWorldSize": 3},
            {"refitInfo": {"configMapRef": {"name": "a", "key": "b"}, "sha256": "0" * 64, "tensors": 1}},
            "exclude each other",
        ),
    ],
    ids=["two-stages", "one-stage", "sub-world", "stages-times-ranks", "with-refit-info"],
)
def test_nemo_reshard_must_fit_the_sessions_world(reshard: Object, more: Object, problem: str | None) -> None:
    spec = {"fleetRef": {"name": "tiny"}, "nemoCollective": COLLECTIVE, "nemoReshard": reshard, **more}
    if problem is None:
        parsed = v1alpha1.RefitSessionSpec.model_validate(spec)
        assert parsed.nemo_reshard is not None and len(parsed.nemo_reshard.stages) == len(reshard["stages"])
        return
    with pytest.raises(pydantic.ValidationError, match=problem):
        v1alpha1.RefitSessionSpec.model_validate(spec)


# -- the reshard refit info ----------------------------------------------------------------------------


def packed(info: Any) -> bytes:
    return gzip.compress(json.dumps(info).encode())


@pytest.mark.parametrize(
    ("info", "tensors", "problem"),
    [
        (RESHARD_INFO, 3, None),
        (RESHARD_INFO, 4, "holds 3 tensors, refitInfo.tensors says 4"),
        ([["a", [1], "float32"]], 1, "is not NeMo's reshard refit info"),
        ({**RESHARD_INFO, "layer_names": ["model.layers.9"]}, 1, "is not NeMo's reshard refit info"),
        ({**RESHARD_INFO, "misc_meta": {f"t{i}": {"shape": [1] * 9000} for i in range(3)}}, 1, "expands past"),
    ],
    ids=["fits", "miscounted", "a-list", "unknown-layer", "too-large-for-its-count"],
)
def test_the_reshard_refit_info_is_read_only_as_far_as_its_count_allows(
    info: Any, tensors: int, problem: str | None
) -> None:
    data = packed(info)
    digest = hashlib.sha256(data).hexdigest()
    if problem is None:
        assert reshard_info_check.parse(data, sha256=digest, tensors=tensors, source="cm") == info
        return
    with pytest.raises(refit_info_check.RefitInfoError, match=problem):
        reshard_info_check.parse(data, sha256=digest, tensors=tensors, source="cm")
    with pytest.raises(refit_info_check.RefitInfoError, match="sha256"):
        reshard_info_check.parse(data, sha256="0" * 64, tensors=tensors, source="cm")


# -- the stages' verdicts ----------------------------------------------------------------------------


def member(rank: int, phase: str | None, error: str | None = None) -> agent_api.NemoWorldStatus:
    stages = None if phase is None else agent_api.NemoReshardStatus(phase=phase, stages=2, rank=rank - 1, error=error)
    return agent_api.NemoWorldStatus(session="grpo-uid", phase="joined", rank=rank, reshard=stages)


@pytest.mark.parametrize(
    ("worlds", "pods", "expected"),
    [
        ((member(2, "joined"), member(3, "joined")), 2, ("joined", "2 member pods joined the stage communicators")),
        ((member(2, "joined"), member(3, "joining")), 2, ("joining", "rank 3 is still joining")),
        ((member(2, "joined"),), 2, ("joining", "1 member pods did not answer")),
        ((member(2, "joined"), member(3, None)), 2, ("joining", "rank 3 has not been asked")),
        (
            (member(2, "joined"), member(3, "failed", "store timeout")),
            2,
            ("lost", "rank 3 (stage rank 2) lost its stage communicators: store timeout"),
        ),
        ((member(2, "left"), member(3, "joined")), 2, ("lost", "rank 2 (stage rank 1) lost its stage communicators")),
    ],
    ids=["joined", "joining", "unanswered", "not-asked", "failed", "left"],
)
def test_the_members_stages_are_joined_only_when_every_member_pod_says_so(
    worlds: tuple[agent_api.NemoWorldStatus, ...], pods: int, expected: tuple[str, str]
) -> None:
    state, message = session_reshard.verdict(worlds, pods)
    assert state == expected[0] and message.startswith(expected[1]), message


# -- the controllers ----------------------------------------------------------------------------------


def joined_reshard(world: World, *, info: Object | None = RESHARD_INFO) -> Object:
    """A joined session whose members were asked to join two stages (its refit info written)."""
    world.session()
    world.joined()
    world.reshard(info=info)
    return world.advance()


def test_the_members_join_every_stage_at_their_stage_rank_once_the_world_is_joined(world: World) -> None:
    asked = joined_reshard(world)

    waiting = condition(asked, session_reshard.RESHARD_JOINED)
    assert (waiting["status"], waiting["reason"]) == ("False", "Joining")
    assert "2 shards join 2 stage communicators of 3 ranks" in waiting["message"]
    ips = world.pod_ips()
    assert [(ip, body.rank_offset) for ip, body in world.agents.stage_joins] == [
        (ips["tiny-s0-p0"], 1),  # trainerRanksPerStage 1 + the shard's prefix 0
        (ips["tiny-s1-p0"], 2),
    ]
    body = world.agents.stage_joins[0][1]
    assert (body.session, body.sub_world_size, body.trainer_ranks_per_stage) == ("grpo-uid", 3, 1)
    assert [(stage.address, stage.port) for stage in body.stages] == [("127.0.9.3", 29800), ("127.0.9.4", 29801)]
    accepted = condition(asked, session_status.REFIT_INFO_ACCEPTED)
    assert accepted["status"] == "True" and accepted["message"].startswith("3 tensors")
    assert condition(world.advance(), session_reshard.RESHARD_JOINED)["status"] == "False", "one still joins"

    world.agents.settle_stages("joined")
    found = condition(world.advance(), session_reshard.RESHARD_JOINED)
    assert (found["status"], found["reason"]) == ("True", "AllMembersJoined")
    world.advance()
    assert len(world.agents.stage_joins) == 2, "each member is asked once"
    assert world.api.objects[("RefitSession", NS, "grpo")]["status"]["phase"] == "Joined"


@pytest.mark.parametrize("how", ["refused", "failed", "timed-out"])
def test_a_failed_stage_join_fails_the_session_and_every_member_leaves(world: World, how: str) -> None:
    ips = world.pod_ips()
    world.session()
    world.joined()
    world.reshard()
    if how == "refused":
        world.agents.refuse_join[ips["tiny-s1-p0"]] = "HTTP 409: not joined"
        world.advance()
    elif how == "failed":
        world.advance()
        world.agents.settle_stages("failed", error="stage 1's store timed out", only=ips["tiny-s1-p0"])
        world.advance()
    else:
        world.advance()
        world.now += datetime.timedelta(seconds=60 + world.settings.session.join_grace_seconds + 1)
        world.advance()

    session = world.api.objects[("RefitSession", NS, "grpo")]
    found = condition(session, session_status.JOINED)
    assert session["status"]["phase"] == "Failed" and found["reason"] == session_status.JOIN_FAILED
    expected = {"refused": "pod tiny-s1-p0 refused", "failed": "store timed out", "timed-out": "not joined within 60 s"}
    assert expected[how] in found["message"], found["message"]
    assert sorted(world.agents.leaves) == sorted((ip, "grpo-uid") for ip in ips.values())
    assert world.fleet()["status"]["refit"].get("session") is None


def test_a_member_that_loses_its_stages_breaks_the_session(world: World) -> None:
    joined_reshard(world)
    world.agents.settle_stages("joined")
    world.advance()
    world.agents.settle_stages("left", only=world.pod_ips()["tiny-s0-p0"])

    session = world.advance()

    broken = condition(session, session_status.BROKEN)
    assert session["status"]["phase"] == "Broken" and broken["reason"] == session_status.MEMBER_LOST
    assert "lost its stage communicators" in broken["message"]


def test_a_refit_goes_to_the_reshard_route_only_once_the_stages_are_joined(world: World) -> None:
    joined_reshard(world)
    world.refit(1, {"session": {"name": "grpo"}}, name="early")
    early = world.advance_refit("early")["status"]
    assert early["phase"] == "Failed" and "stage communicators are not joined" in early["message"]
    assert condition(world.api.objects[("Refit", NS, "early")], "Failed")["reason"] == refit_status.SESSION_NOT_JOINED

    world.agents.settle_stages("joined")
    world.advance()
    world.refit(2, {"session": {"name": "grpo"}})
    assert world.advance_refit("tiny-v2")["status"]["phase"] == "Running"
    done = world.advance_refit("tiny-v2")["status"]
    assert done["phase"] == "Succeeded", done
    bodies = [body for _, body in world.agents.starts]
    assert len(bodies) == 2 and all(isinstance(body, agent_api.NemoReshardRefitRequest) for body in bodies)
    first = bodies[0]
    assert isinstance(first, agent_api.NemoReshardRefitRequest)
    assert (first.version, first.session, first.bucket_bytes, first.refit_info) == (2, "grpo-uid", 4096, RESHARD_INFO)


def test_a_refit_through_a_reshard_session_without_its_refit_info_fails_refit_info_missing(world: World) -> None:
    joined_reshard(world, info=None)
    world.agents.settle_stages("joined")
    world.advance()
    world.refit(1, {"session": {"name": "grpo"}})

    status = world.advance_refit("tiny-v1")["status"]

    assert status["phase"] == "Failed" and "no nemoReshard.refitInfo" in status["message"]
    assert condition(world.api.objects[("Refit", NS, "tiny-v1")], "Failed")["reason"] == refit_status.REFIT_INFO_MISSING
    assert world.agents.starts == []


def test_reshard_refit_info_that_does_not_match_its_sha256_breaks_the_session(world: World) -> None:
    joined_reshard(world, info=None)
    data = packed(RESHARD_INFO)
    world.api.objects[("ConfigMap", NS, "grpo-reshard-info")] = {
        "kind": "ConfigMap",
        "metadata": {"name": "grpo-reshard-info", "namespace": NS},
        "binaryData": {"reshardInfo.json.gz": base64.b64encode(data).decode()},
    }
    reshard = world.api.objects[("RefitSession", NS, "grpo")]["spec"]["nemoReshard"]
    reshard["refitInfo"] = {
        "configMapRef": {"name": "grpo-reshard-info", "key": "reshardInfo.json.gz"},
        "sha256": "0" * 64,
        "tensors": 3,
    }

    session = world.advance()

    rejected = condition(session, session_status.BROKEN)
    assert session["status"]["phase"] == "Broken" and rejected["reason"] == session_status.REFIT_INFO_REJECTED
