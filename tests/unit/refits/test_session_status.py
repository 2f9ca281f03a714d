"""The RefitSession's pure status functions: whether the fleet can field the trainer's world, what a
session does without its fleet, the updates that start and finish the join or end the session, the
refit info's conditions and its check, and when the trainer counts as gone."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from typing import Any

import pytest

from megafleet import desired, planner
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.refits import refit_info_check, session_status, session_view
from megafleet_protocol import agent_api

NOW = "2026-01-01T00:10:00Z"
NATIVE = {"address": "127.0.9.3", "port": 29700, "worldSize": 4, "trainerWorldSize": 2}
NEMO = {**NATIVE, "bucketBytes": 4096}


def session(status: Object | None = None, **spec: Any) -> session_view.Session:
    body: Object = {
        "metadata": {"name": "grpo", "namespace": "rl", "uid": "grpo-uid", "generation": 3},
        "spec": {"fleetRef": {"name": "tiny"}, **(spec or {"nemoCollective": NEMO})},
    }
    if status is not None:
        body["status"] = status
    return session_view.Session.parse(body)


def fleet(replicas: int = 2, **engine: Any) -> desired.ParsedFleet:
    spec = v1alpha1.MegatronGenerationSpec.model_validate(
        {"model": {"source": "/models/m"}, "replicas": replicas, "engine": engine}
    )
    return desired.ParsedFleet("tiny", "rl", "uid-1", 1, spec)


@pytest.mark.parametrize(
    ("spec", "parsed", "expected"),
    [
        pytest.param({"nemoCollective": NEMO}, fleet(2), None, id="fits"),
        pytest.param(
            {"nemoCollective": {**NEMO, "worldSize": 5}},
            fleet(2),
            (session_status.WORLD_SIZE_MISMATCH, "the trainer's inference world is 3 ranks"),
            id="world-size-mismatch",
        ),
        pytest.param(
            {"megatronNative": NATIVE},
            fleet(2, backend="transformers"),
            (session_status.BACKEND_NOT_SUPPORTED, "megatronNative needs engine.backend megatron"),
            id="megatron-native-on-transformers",
        ),
        pytest.param({"megatronNative": NATIVE}, fleet(2, backend="megatron"), None, id="megatron-native"),
    ],
)
def test_the_fleet_must_field_exactly_the_trainers_inference_world(
    spec: Object, parsed: desired.ParsedFleet, expected: tuple[str, str] | None
) -> None:
    parsed_spec = v1alpha1.RefitSessionSpec.model_validate({"fleetRef": {"name": "tiny"}, **spec})
    found = session_status.check(parsed_spec, parsed)
    if expected is None:
        assert found is None
        return
    assert found is not None and found[0] == expected[0] and found[1].startswith(expected[1]), found


@pytest.mark.parametrize(
    ("phase", "exists", "expected"),
    [
        ("Pending", False, ("Pending", None, "fleet tiny does not exist")),
        ("Pending", True, ("Pending", None, "fleet tiny has an invalid spec")),
        ("Joining", False, ("Failed", session_status.JOIN_FAILED, "fleet tiny is gone or invalid")),
        ("Joined", True, ("Broken", session_status.MEMBER_LOST, "fleet tiny is gone or invalid")),
    ],
    ids=["pending-gone", "pending-invalid", "joining", "joined"],
)
def test_without_its_fleet_a_pending_session_waits_a_joining_one_fails_a_joined_one_breaks(
    phase: str, exists: bool, expected: tuple[str, str | None, str]
) -> None:
    assert session_status.without_fleet(phase, "tiny", exists) == expected


def test_the_join_publishes_the_membership_and_names_the_ranks() -> None:
    membership = planner.Membership(world_size=4, trainer_world_size=2, offsets={0: 2, 1: 3})
    assert session_status.joining(session(), membership, 2) == {
        "phase": "Joining",
        "membership": {
            "worldSize": 4,
            "trainerWorldSize": 2,
            "rankOffsets": [{"shard": 0, "offset": 2}, {"shard": 1, "offset": 3}],
        },
        "message": "2 shards join 127.0.9.3:29700 as ranks 2..3 of 4",
    }


def world(generation: str | None = None, reachable: bool | None = True) -> agent_api.NemoWorldStatus:
    return agent_api.NemoWorldStatus(
        session="grpo-uid", phase="joined", rank=2, generation=generation, store_reachable=reachable
    )


@pytest.mark.parametrize(
    ("worlds", "generation"),
    [((world(), world("nemo")), "nemo"), ((world(), world()), None)],
    ids=["reported", "none-reported"],
)
def test_joined_records_the_generation_the_members_report(
    worlds: tuple[agent_api.NemoWorldStatus, ...], generation: str | None
) -> None:
    found = session_status.joined(session(), worlds, NOW)
    [condition] = found.pop("conditions")
    message = "2 fleet ranks joined the trainer's world at 127.0.9.3:29700 (4 ranks)"
    assert condition == {
        "type": "Joined",
        "status": "True",
        "reason": "AllMembersJoined",
        "message": message,
        "lastTransitionTime": NOW,
        "observedGeneration": 3,
    }
    assert found == {"phase": "Joined", "message": message, **({"generation": generation} if generation else {})}


@pytest.mark.parametrize(
    ("phase", "reason", "conditions"),
    [
        ("Failed", session_status.JOIN_FAILED, {"Joined": ("False", "JoinFailed")}),
        ("Closed", session_status.TRAINER_GONE, {"Joined": ("False", "TrainerGone")}),
        (
            "Broken",
            session_status.MEMBER_LOST,
            {"Joined": ("False", "MemberLost"), "Broken": ("True", "MemberLost")},
        ),
    ],
    ids=["failed", "closed", "broken"],
)
def test_an_end_says_why_and_only_a_broken_session_is_broken(
    phase: str, reason: str, conditions: dict[str, tuple[str, str]]
) -> None:
    found = session_status.ended(session(), phase, reason, "why", NOW)
    assert (found["phase"], found["message"]) == (phase, "why")
    assert {c["type"]: (c["status"], c["reason"]) for c in found["conditions"]} == conditions


def test_the_refit_info_conditions() -> None:
    ref = {"configMapRef": {"name": "grpo-info", "key": "k"}, "sha256": "ab" * 32, "tensors": 2}
    held = session(nemoCollective=NEMO, refitInfo=ref)
    [waiting] = session_status.refit_info_waiting(held, "ConfigMap grpo-info key k does not exist", NOW)["conditions"]
    assert (waiting["type"], waiting["status"], waiting["reason"]) == ("RefitInfoAccepted", "False", "Waiting")
    [accepted] = session_status.refit_info_accepted(held, 2, NOW)["conditions"]
    expected = ("True", "Checked", "2 tensors, sha256 abababababab…")
    assert (accepted["status"], accepted["reason"], accepted["message"]) == expected


@pytest.mark.parametrize(
    ("worlds", "member_pods", "expected"),
    [
        ((world(reachable=False), world(reachable=False)), 2, True),
        ((world(reachable=False), world(reachable=True)), 2, False),
        ((world(reachable=False), world(reachable=None)), 2, False),
        ((world(reachable=False),), 2, False),
    ],
    ids=["every-member", "one-reaches-it", "one-does-not-know", "one-did-not-answer"],
)
def test_the_trainer_counts_as_gone_only_when_every_member_finds_its_store_unreachable(
    worlds: tuple[agent_api.NemoWorldStatus, ...], member_pods: int, expected: bool
) -> None:
    assert session_status.store_unreachable(worlds, member_pods) is expected


INFO = [["model.embed_tokens.weight", [32, 8], "torch.float32"], ["lm_head.weight", [32, 8], "torch.float32"]]


def packed(entries: Any) -> bytes:
    return gzip.compress(json.dumps(entries).encode())


@pytest.mark.parametrize(
    ("data", "sha256", "expected"),
    [
        (packed(INFO), None, None),
        (packed(INFO), "0" * 64, "is not refitInfo.sha256 000000"),
        (b"not gzip", None, "is not gzip'd JSON"),
        (packed(INFO[:1]), None, "holds 1 tensors, refitInfo.tensors says 2"),
        (packed({"a": 1}), None, "holds no list of tensors"),
        (packed([["x", [1]], ["y", [1]]]), None, "an entry is not [name, shape, dtype]"),
    ],
    ids=["valid", "sha256", "not-gzip", "count", "not-a-list", "bad-entry"],
)
def test_the_refit_info_is_checked_against_its_sha256_and_count(
    data: bytes, sha256: str | None, expected: str | None
) -> None:
    digest = sha256 or hashlib.sha256(data).hexdigest()
    if expected is None:
        found = refit_info_check.parse(data, sha256=digest, tensors=2, source="ConfigMap c key k")
        assert [[t.name, t.shape, t.dtype] for t in found] == INFO
        return
    with pytest.raises(refit_info_check.RefitInfoError, match=re.escape(expected)) as error:
        refit_info_check.parse(data, sha256=digest, tensors=2, source="ConfigMap c key k")
    assert not error.value.missing
