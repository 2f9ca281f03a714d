"""The operator's half of the two-phase commit: the pure decision (:func:`megafleet.refits.commit.commit_decision`)
and the commit the members are told (:func:`megafleet.refits.modes.commit_mode`) as tables, then the
Refit controller against an in-memory API and fake members (:mod:`helpers.refit_world`): the decision
is written (``status.commit.decidedTime``) before any member is told to switch; a member that fails
before it fails the attempt with no commit sent; one that fails after it is fenced (its shard Stale,
the Refit Succeeded and Degraded); an operator restarted after the decision pushes the commit to the
members still staged without deciding again; members that cannot all stage in time fail the attempt
``CommitExpired``; a fleet at its defaults sends no commit at all."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from helpers.refit_world import NS, World, condition
from megafleet import agent_client
from megafleet.objects import Object
from megafleet.refits import commit, member_reports, modes, refit_status
from megafleet_protocol import agent_api, vocabulary

STARTED = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
STAGES = agent_api.Capabilities(keep_modes=["persist", "recompute"], staging_bytes=1 << 20)
CHECKPOINT = {"checkpoint": {"path": "/ckpt/1"}}
OPERATOR = {"requested": "operator", "mode": "operator"}


def member(shard: int, phase: vocabulary.AttemptPhase) -> member_reports.MemberReport:
    report = agent_api.RefitStatusResponse(
        phase=phase,
        version=1,
        source="checkpoint",
        transport=None,
        rank=None,
        world_size=None,
        phases=[],
        duration_milliseconds=None,
        bytes_received=0,
        buckets=0,
        tensors_written=0,
        error=None,
        timed_out=False,
        dirty=False,
        state="ready",
        weight_version=0,
    )
    return member_reports.MemberReport(shard, f"tiny-s{shard}-p0", report)


def decide(status: Object, phases: list[vocabulary.AttemptPhase], *, after: float, pods: int = 2) -> object:
    reports = [member(shard, phase) for shard, phase in enumerate(phases)]
    now = STARTED + datetime.timedelta(seconds=after)
    return commit.commit_decision(status, reports, now, pods=pods, wait_seconds=60)


RUNNING = {"startTime": "2026-01-01T00:00:00Z", "commit": OPERATOR}
DECIDED = {**RUNNING, "commit": {**OPERATOR, "decidedTime": "2026-01-01T00:00:05Z"}}


@pytest.mark.parametrize(
    ("status", "phases", "after", "pods", "expected"),
    [
        (RUNNING, ["staged", "staged"], 5, 2, commit.Commit(decided=False)),
        (RUNNING, ["staged", "succeeded"], 5, 2, commit.Commit(decided=False)),  # one switched on its own
        (RUNNING, ["staged", "switching"], 5, 2, commit.Commit(decided=False)),
        (RUNNING, ["staged", "staging"], 5, 2, commit.Wait("shard 1, pod tiny-s1-p0 is staging")),
        (RUNNING, ["staged"], 5, 2, commit.Wait("1 of 2 member pods reported")),
        (DECIDED, ["staged", "staging"], 5, 2, commit.Commit(decided=True)),  # on record: push, never undo
        (DECIDED, ["staged", "staging"], 500, 2, commit.Commit(decided=True)),
        (RUNNING, ["staged", "staged"], 500, 2, commit.Commit(decided=False)),  # they staged: late is fine
    ],
)
def test_the_commit_decision(
    status: Object, phases: list[vocabulary.AttemptPhase], after: float, pods: int, expected: object
) -> None:
    assert decide(status, phases, after=after, pods=pods) == expected


@pytest.mark.parametrize("after", [58, 58.5, 59, 300])
def test_members_that_cannot_all_stage_before_their_wait_runs_out_abort(after: float) -> None:
    decision = decide(RUNNING, ["staged", "staging"], after=after)

    assert isinstance(decision, commit.Abort)
    assert decision.message.startswith("CommitExpired: not every member staged within timeoutSeconds plus")
    assert "shard 1, pod tiny-s1-p0 had not" in decision.message


def test_a_decision_just_before_the_margin_still_waits() -> None:
    assert isinstance(decide(RUNNING, ["staged", "staging"], after=57.5), commit.Wait)


@pytest.mark.parametrize(
    ("requested", "staged", "trainer", "expected"),
    [
        ("local", True, True, ("local", None)),
        ("local", False, False, ("local", None)),
        ("operator", True, False, ("operator", None)),
        ("operator", True, True, ("operator", None)),
        ("trainer", True, True, ("trainer", None)),
        ("trainer", True, False, ("operator", modes.NO_TRAINER_COMMIT)),
        ("trainer", False, True, ("local", modes.IN_PLACE_COMMITS_LOCAL)),
        ("operator", False, False, ("local", modes.IN_PLACE_COMMITS_LOCAL)),
    ],
)
def test_the_commit_every_member_is_told(
    requested: vocabulary.CommitMode, staged: bool, trainer: bool, expected: tuple[str, str | None]
) -> None:
    assert modes.commit_mode(requested, staged=staged, trainer=trainer) == expected


# -- the controller ------------------------------------------------------------------------------


def staged_world(**refit: Any) -> tuple[World, dict[str, str]]:
    """The two-shard world with engines that stage, its members staged once told to receive."""
    world = World(refit={"staging": "auto", "commit": "operator", "commitGraceSeconds": 20, **refit})
    world.start()
    ips = world.pod_ips()
    for ip in ips.values():
        world.agents.capabilities[ip] = STAGES
        world.agents.refit_phase[ip] = "staged"
        world.agents.reports[ip] = {"commit": {"requested": "operator", "effective": "operator"}}
    world.refit(1, CHECKPOINT)
    return world, ips


def refit_body(world: World) -> Object:
    return world.api.objects[("Refit", NS, "tiny-v1")]


class WriteAheadAgents:
    """Checks, at every commit call, that the decision is already on record in the API."""

    def __init__(self, world: World) -> None:
        self.world = world

    def __call__(self) -> None:
        assert commit.decided_time(refit_body(self.world).get("status") or {}) is not None, "commit before the record"


def test_the_decision_is_recorded_before_any_member_is_told_to_switch() -> None:
    world, ips = staged_world()
    on_record = WriteAheadAgents(world)
    told = world.agents.refit_commit

    async def checked(pod_ip: str, token: str, version: int) -> str | None:
        on_record()
        return await told(pod_ip, token, version)

    world.agents.refit_commit = checked  # type: ignore[method-assign]

    running = world.advance_refit("tiny-v1")["status"]
    assert running["phase"] == "Running" and running["commit"] == OPERATOR
    assert [agent_client._json(body)["commit"] for _, body in world.agents.starts] == ["operator", "operator"]
    assert [agent_client._json(body)["commitGraceSeconds"] for _, body in world.agents.starts] == [20, 20]
    decided = world.advance_refit("tiny-v1")["status"]
    assert decided["phase"] == "Running" and decided["commit"]["decidedTime"]
    assert sorted(world.agents.commits) == sorted((ip, 1) for ip in ips.values())
    done = world.advance_refit("tiny-v1")["status"]

    assert done["phase"] == "Succeeded", done
    assert done["commit"]["decidedTime"] == decided["commit"]["decidedTime"]
    assert world.fleet()["status"]["refit"]["currentVersion"] == 1


def test_a_member_that_fails_before_the_commit_fails_the_attempt_and_no_commit_is_sent() -> None:
    world, ips = staged_world()
    world.advance_refit("tiny-v1")
    world.agents.refit_phase[ips["tiny-s1-p0"]] = "failed"

    status = world.advance_refit("tiny-v1")["status"]

    assert status["phase"] == "Pending" and "attempt 1 failed" in status["message"]
    assert world.agents.commits == []
    assert sorted(world.agents.aborts) == sorted(ips.values())
    assert "decidedTime" not in (status.get("commit") or {})


def test_a_member_that_fails_after_the_commit_is_fenced_and_the_refit_succeeds_degraded() -> None:
    world, ips = staged_world()
    world.agents.after_commit[ips["tiny-s1-p0"]] = "failed"
    world.advance_refit("tiny-v1")
    world.advance_refit("tiny-v1")  # decided and pushed

    done = world.advance_refit("tiny-v1")["status"]

    assert done["phase"] == "Succeeded", done
    assert "shards 1 failed to switch after the commit" in done["message"]
    degraded = condition(refit_body(world), refit_status.DEGRADED)
    assert (degraded["status"], degraded["reason"]) == ("True", refit_status.SWITCH_FAILED)
    assert "shard 1: tiny-s1-p0: bucket 2 of 3 not received" in degraded["message"]
    assert world.agents.aborts == []  # nothing to stop: the version is decided
    fleet = world.fleet()["status"]
    assert fleet["refit"]["currentVersion"] == 1
    shards = {entry["index"]: entry for entry in fleet["shards"]}
    assert shards[1]["phase"] == "Stale" and "failed to switch" not in shards[1]["lastError"]
    assert shards[0]["phase"] == "Ready" and shards[0]["weightVersion"] == 1


def test_an_operator_restarted_after_the_decision_pushes_the_commit_to_the_members_still_staged() -> None:
    world, ips = staged_world()
    world.advance_refit("tiny-v1")
    body = refit_body(world)
    decided_at = "2026-01-01T00:00:05Z"
    body["status"]["commit"] = {**OPERATOR, "decidedTime": decided_at}  # written, then the operator died
    world.agents.refit_phase[ips["tiny-s0-p0"]] = "succeeded"  # told before it died; shard 1 was not

    world.advance_refit("tiny-v1")

    assert world.agents.commits == [(ips["tiny-s1-p0"], 1)]
    assert refit_body(world)["status"]["commit"]["decidedTime"] == decided_at  # not decided again
    assert world.advance_refit("tiny-v1")["status"]["phase"] == "Succeeded"


def test_members_that_cannot_all_stage_in_time_fail_the_attempt_commit_expired() -> None:
    world, ips = staged_world()
    world.advance_refit("tiny-v1")
    refit_body(world)["status"]["startTime"] = "2020-01-01T00:00:00Z"  # long past timeout + grace
    world.agents.refit_phase[ips["tiny-s1-p0"]] = "staging"

    status = world.advance_refit("tiny-v1")["status"]

    assert status["phase"] == "Pending"
    assert status["message"].startswith("attempt 1 failed: CommitExpired")
    assert world.agents.commits == []
    assert sorted(world.agents.aborts) == sorted(ips.values())


def test_in_place_members_commit_local_and_the_status_says_why() -> None:
    world = World(refit={"commit": "operator"})
    world.start()
    world.refit(1, CHECKPOINT)

    running = world.advance_refit("tiny-v1")["status"]

    assert running["commit"] == {"requested": "operator", "mode": "local", "reason": modes.IN_PLACE_COMMITS_LOCAL}
    assert all("commit" not in agent_client._json(body) for _, body in world.agents.starts)
    assert world.advance_refit("tiny-v1")["status"]["phase"] == "Succeeded"
    assert world.agents.commits == []


def test_a_fleet_at_its_defaults_records_and_sends_no_commit() -> None:
    world = World(refit={"staging": "auto"})
    world.start()
    for ip in world.pod_ips().values():
        world.agents.capabilities[ip] = STAGES
    world.refit(1, CHECKPOINT)

    running = world.advance_refit("tiny-v1")["status"]

    assert "commit" not in running
    assert all("commit" not in agent_client._json(body) for _, body in world.agents.starts)
    assert world.advance_refit("tiny-v1")["status"]["phase"] == "Succeeded"


def test_the_refit_override_asks_for_the_trainer_commit_on_a_rendezvous_source() -> None:
    world = World(refit={"staging": "auto"})
    world.start()
    for ip in world.pod_ips().values():
        world.agents.capabilities[ip] = STAGES
    world.refit(1, {"rendezvous": {"address": "10.0.0.1", "port": 29600}})
    refit_body(world)["spec"]["commit"] = "trainer"

    running = world.advance_refit("tiny-v1")["status"]

    assert running["commit"] == {"requested": "trainer", "mode": "trainer"}
    assert [agent_client._json(body)["commit"] for _, body in world.agents.starts] == ["trainer", "trainer"]
    assert world.advance_refit("tiny-v1")["status"]["phase"] == "Succeeded"  # the trainer decides
    assert world.agents.commits == []
