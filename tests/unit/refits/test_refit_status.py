"""The Refit's pure status functions: which Refits pruning deletes, the version a new Refit must be
above and why a Pending one is refused, the Refit's last status, and the fleet's patch that ends a
refit (the lock released, the version moved on, the member shards' readiness settled at once)."""

from __future__ import annotations

from typing import Any

import pytest

from helpers.refit_world import T, refit
from megafleet import conditions, planner
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.refits import modes, refit_status
from megafleet_protocol import agent_api


@pytest.mark.parametrize(
    ("refits", "limit", "expected"),
    [
        pytest.param(
            [refit(f"r{v}", v, "Succeeded", f"{T}{v:02d}Z") for v in range(1, 6)],
            2,
            ["r1", "r2", "r3"],
            id="oldest-first",
        ),
        pytest.param(
            [refit("r1", 1, "Succeeded", f"{T}01Z"), refit("r2", 2, "Running", f"{T}02Z")],
            0,
            ["r1"],
            id="never-running",
        ),
        pytest.param(
            [refit("r1", 1, "Pending", f"{T}01Z"), refit("r2", 2, "Failed", f"{T}02Z")],
            0,
            [],
            id="never-pending-or-newest",
        ),
        pytest.param(
            # a stale Refit refused as VersionNotNewer is the newest: sorting by version alone would
            # prune it first, under the eyes of the trainer still watching it
            [
                refit("r5", 5, "Succeeded", f"{T}01Z"),
                refit("r6", 6, "Succeeded", f"{T}02Z"),
                refit("stale", 3, "Failed", f"{T}03Z"),
            ],
            1,
            ["r5"],
            id="newest-by-creation-and-highest-version-kept",
        ),
        pytest.param(
            [refit(f"r{v}", v, "Succeeded", f"{T}00Z") for v in (3, 1, 2)], 1, ["r1", "r2"], id="same-second-by-version"
        ),
        pytest.param([], 3, [], id="none"),
    ],
)
def test_pruning_deletes_only_old_finished_refits(refits: list[Object], limit: int, expected: list[str]) -> None:
    assert refit_status.prunable(refits, limit) == expected


def test_the_version_to_beat_is_the_current_one_else_what_every_shard_serves() -> None:
    assert refit_status.current_version({"refit": {"currentVersion": 4}, "weightVersion": 4}) == 4
    assert refit_status.current_version({"weightVersion": 0}) == 0  # served from the checkpoint
    assert refit_status.current_version({"refit": {"active": "x"}}) is None  # no weights anywhere yet


def test_a_successful_refit_marks_its_reporting_members_ready_at_the_new_version() -> None:
    shards = [
        {"index": 0, "phase": "Refitting", "weightVersion": 3, "lastError": "suspended"},
        {"index": 1, "phase": "Ready", "weightVersion": 3},
        {"index": 2, "phase": "Starting"},
    ]
    settled = refit_status.settled_shards(shards, [0, 1], 4)
    assert settled == [
        {"index": 0, "phase": "Ready", "weightVersion": 4},
        {"index": 1, "phase": "Ready", "weightVersion": 4},
        {"index": 2, "phase": "Starting"},
    ]
    assert shards[0]["phase"] == "Refitting"  # the input is not changed


def test_a_successful_refit_settles_readiness_and_weights_current_in_the_same_patch() -> None:
    before: Object = {
        "shards": [
            {"index": 0, "phase": "Refitting", "weightVersion": 3},
            {"index": 1, "phase": "Refitting", "weightVersion": 3},
        ],
        "readyReplicas": 0,
        "weightVersion": 3,
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "ShardsNotReady", "lastTransitionTime": "t0"},
            {"type": "WeightsCurrent", "status": "False", "reason": "Refitting", "lastTransitionTime": "t0"},
        ],
    }
    settled = refit_status.settled_status(before, [0, 1], 4, replicas=2, generation=7, now="t1")
    assert settled["readyReplicas"] == 2 and settled["weightVersion"] == 4
    found = {c["type"]: c for c in settled["conditions"]}
    assert (found["Ready"]["status"], found["Ready"]["reason"], found["Ready"]["lastTransitionTime"]) == (
        "True",
        "AllShardsReady",
        "t1",
    )
    assert (found["WeightsCurrent"]["status"], found["Degraded"]["status"]) == ("True", "False")
    # One member not settled: not Ready, Degraded, not current (the Ready shard's version is reported,
    # as the reconcile reports it).
    partial = refit_status.settled_status(before, [0], 4, replicas=2, generation=7, now="t1")
    found = {c["type"]: c for c in partial["conditions"]}
    assert partial["readyReplicas"] == 1 and partial["weightVersion"] == 4
    assert (found["Ready"]["status"], found["Degraded"]["status"], found["WeightsCurrent"]["status"]) == (
        "False",
        "True",
        "False",
    )
    # A shard failing after restarts stays named until every shard is Ready again.
    failing = {"type": "Degraded", "status": "True", "reason": "ShardsFailing", "message": "shard 1: crash"}
    with_failing = {**before, "conditions": [*before["conditions"], failing]}
    kept = refit_status.settled_status(with_failing, [0], 4, replicas=2, generation=7, now="t1")
    assert {c["type"]: c for c in kept["conditions"]}["Degraded"] == failing
    healed = refit_status.settled_status(with_failing, [0, 1], 4, replicas=2, generation=7, now="t1")
    assert {c["type"]: c["reason"] for c in healed["conditions"]}["Degraded"] == "AsDesired"


def spec(version: int, **source: Any) -> v1alpha1.RefitObjectSpec:
    return v1alpha1.RefitObjectSpec.model_validate(
        {
            "fleetRef": {"name": "tiny"},
            "version": version,
            "source": source or {"rendezvous": {"address": "10.0.0.1", "port": 29600}},
        }
    )


@pytest.mark.parametrize(
    ("version", "source", "fleet_status", "expected"),
    [
        pytest.param(5, {}, {}, None, id="first-refit"),
        pytest.param(5, {}, {"refit": {"currentVersion": 4}}, None, id="newer"),
        pytest.param(
            4,
            {},
            {"refit": {"currentVersion": 4}},
            (refit_status.VERSION_NOT_NEWER, "version 4 is not above fleet tiny's current version 4"),
            id="same-version",
        ),
        pytest.param(
            0,
            {},
            {"weightVersion": 0},
            (refit_status.VERSION_NOT_NEWER, "version 0 is not above fleet tiny's current version 0"),
            id="checkpoint-version",
        ),
        pytest.param(
            5,
            {"checkpoint": {"path": "/ckpt/5"}},
            {"refit": {"session": "grpo"}},
            (refit_status.SESSION_HELD, "fleet tiny is held by RefitSession grpo: a checkpoint refit would drop"),
            id="checkpoint-while-held",
        ),
        pytest.param(
            5,
            {},
            {"refit": {"session": "grpo"}},
            (refit_status.SESSION_HELD, "fleet tiny is held by RefitSession grpo: a rendezvous refit would drop"),
            id="rendezvous-while-held",
        ),
        pytest.param(5, {"session": {"name": "grpo"}}, {"refit": {"session": "grpo"}}, None, id="through-the-session"),
        pytest.param(
            3,
            {"session": {"name": "grpo"}},
            {"refit": {"session": "grpo", "currentVersion": 3}},
            (refit_status.VERSION_NOT_NEWER, "version 3 is not above"),
            id="through-the-session-not-newer",
        ),
    ],
)
def test_a_pending_refit_is_refused_only_when_not_newer_or_beside_a_sessions_hold(
    version: int, source: Object, fleet_status: Object, expected: tuple[str, str] | None
) -> None:
    found = refit_status.refused(spec(version, **source), fleet_status)
    if expected is None:
        assert found is None
        return
    assert found is not None and (found.phase, found.reason) == ("Failed", expected[0])
    assert found.message.startswith(expected[1]), found.message


def test_a_membership_is_published_in_shard_order() -> None:
    found = planner.Membership(world_size=4, trainer_world_size=2, offsets={1: 3, 0: 2})
    assert refit_status.membership(found) == {
        "worldSize": 4,
        "trainerWorldSize": 2,
        "rankOffsets": [{"shard": 0, "offset": 2}, {"shard": 1, "offset": 3}],
    }


def report(shard_ms: int, phases: dict[str, int]) -> agent_api.RefitStatusResponse:
    return agent_api.RefitStatusResponse(
        phase="succeeded",
        version=4,
        source="checkpoint",
        transport=None,
        rank=None,
        world_size=None,
        phases=[agent_api.PhaseTiming(name=name, milliseconds=ms) for name, ms in phases.items()],
        duration_milliseconds=shard_ms,
        bytes_received=0,
        buckets=0,
        tensors_written=0,
        error=None,
        timed_out=False,
        dirty=False,
        state="ready",
        weight_version=4,
        world=None,
    )


def test_a_success_keeps_the_longest_phase_and_duration_of_any_member_and_its_checkpoint() -> None:
    reports = [report(30, {"load": 10, "swap": 5}), report(20, {"load": 12, "swap": 1})]
    found = refit_status.succeeded(spec(4, checkpoint={"path": "/ckpt/4"}), [0, 1], reports, [1])
    assert found == refit_status.Outcome(
        "Succeeded",
        "2 shards serve version 4",
        phases=[{"name": "load", "milliseconds": 12}, {"name": "swap", "milliseconds": 5}],
        duration=30,
        version=4,
        checkpoint="/ckpt/4",
        serving=(1,),
    )
    assert refit_status.succeeded(spec(4), [0], reports[:1], [0]).checkpoint is None


NOW = "2026-01-01T00:10:00Z"


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        pytest.param(
            refit_status.failed("fleet tiny does not exist"),
            {"type": "Failed", "status": "True", "reason": "Failed", "message": "fleet tiny does not exist"},
            id="failed",
        ),
        pytest.param(
            refit_status.failed("version 4 is not above", refit_status.VERSION_NOT_NEWER),
            {"type": "Failed", "status": "True", "reason": "VersionNotNewer", "message": "version 4 is not above"},
            id="failed-with-a-reason",
        ),
        pytest.param(
            refit_status.Outcome("Succeeded", "2 shards serve version 4", phases=[], duration=9, version=4),
            {"type": "Complete", "status": "True", "reason": "Succeeded", "message": "2 shards serve version 4"},
            id="succeeded",
        ),
    ],
)
def test_the_refits_last_status_says_how_it_ended(outcome: refit_status.Outcome, expected: Object) -> None:
    found = refit_status.final(refit("tiny-v4", 4, "Running", f"{T}01Z"), outcome, NOW)
    [condition] = found.pop("conditions")
    assert condition == {**expected, "lastTransitionTime": NOW, "observedGeneration": 1}
    timing = {"phases": [], "durationMilliseconds": 9} if outcome.phase == "Succeeded" else {}
    assert found == {"phase": outcome.phase, "message": outcome.message, "completionTime": NOW, **timing}


def fleet_body(refit_state: Object, shards: list[Object] | None = None) -> Object:
    status: Object = {"refit": refit_state}
    if shards is not None:
        status["shards"] = shards
    return {"metadata": {"name": "tiny", "namespace": "rl", "generation": 2}, "spec": {"replicas": 1}, "status": status}


SUCCESS = refit_status.Outcome("Succeeded", "done", phases=[], duration=7, version=4, checkpoint="/c/4", serving=(0,))


@pytest.mark.parametrize(
    ("fleet", "outcome", "expected"),
    [
        pytest.param(fleet_body({"active": "tiny-v9"}), SUCCESS, None, id="held-by-another"),
        pytest.param(
            fleet_body({"active": "tiny-v4", "currentVersion": 3, "membership": {"worldSize": 2}}),
            refit_status.failed("attempt 1 failed"),
            {"refit": {"active": None, "currentVersion": 3, "membership": {"worldSize": 2}}},
            id="failed-released",
        ),
        pytest.param(
            fleet_body({"active": "tiny-v4", "currentVersion": 3}),
            SUCCESS,
            {
                "refit": {
                    "active": None,
                    "currentVersion": 4,
                    "lastDurationMilliseconds": 7,
                    "lastPhases": [],
                    "currentCheckpoint": "/c/4",
                }
            },
            id="succeeded-version-moves-on",
        ),
        pytest.param(
            fleet_body({"active": None, "currentVersion": 5}),
            SUCCESS,
            {"refit": {"active": None, "currentVersion": 5}},
            id="retried-after-a-later-refit-never-back",
        ),
    ],
)
def test_the_fleets_patch_that_ends_a_refit(
    fleet: Object, outcome: refit_status.Outcome, expected: Object | None
) -> None:
    assert refit_status.released_fleet(fleet, "tiny-v4", outcome, NOW) == expected


def test_the_patch_that_ends_a_successful_refit_settles_its_members_readiness() -> None:
    fleet = fleet_body({"active": "tiny-v4"}, shards=[{"index": 0, "phase": "Refitting", "weightVersion": 3}])
    patch = refit_status.released_fleet(fleet, "tiny-v4", SUCCESS, NOW)
    assert patch is not None
    assert patch["shards"] == [{"index": 0, "phase": "Ready", "weightVersion": 4}]
    assert (patch["readyReplicas"], patch["weightVersion"]) == (1, 4)
    assert {c["type"]: c["status"] for c in patch["conditions"]} == {
        "Ready": "True",
        "Degraded": "False",
        "WeightsCurrent": "True",
    }
    unsettled = refit_status.released_fleet(fleet, "tiny-v4", refit_status.failed("no"), NOW)
    assert unsettled is not None and set(unsettled) == {"refit"}, "a failure settles no shard"


REPORT: Object = {
    "inFlight": {"requested": "keep", "effective": "drain", "kvCacheMode": "persist", "reason": "shard 0 cannot keep"},
    "staging": {"requested": "auto", "effective": "staged", "bytes": 8},
    "pause": {"stallP50Milliseconds": 9, "stallMaxMilliseconds": 11, "gateClosedMaxMilliseconds": 11},
}


def test_a_refits_last_status_carries_the_members_report_and_keep_unavailable() -> None:
    drained = conditions.Verdict(True, modes.ENGINE_DRAINED, "shard 1, pod tiny-s1-p0 ran drain")
    outcome = refit_status.Outcome(
        "Succeeded", "done", phases=[], duration=9, version=4, report=REPORT, keep_unavailable=drained
    )

    found = refit_status.final(refit("tiny-v4", 4, "Running", f"{T}01Z"), outcome, NOW)

    assert {key: found[key] for key in REPORT} == REPORT
    kinds = {condition["type"]: (condition["status"], condition["reason"]) for condition in found["conditions"]}
    assert kinds == {"Complete": ("True", "Succeeded"), "KeepUnavailable": ("True", "EngineDrained")}
    failed = refit_status.final(refit("tiny-v4", 4, "Running", f"{T}01Z"), refit_status.failed("x", report={}), NOW)
    assert [condition["type"] for condition in failed["conditions"]] == ["Failed"]


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        pytest.param(
            REPORT,
            {
                "lastInFlight": {"mode": "drain", "kvCacheMode": "persist", "staging": "staged"},
                "lastStallMilliseconds": 11,
            },
            id="everything-reported",
        ),
        pytest.param(
            {"inFlight": REPORT["inFlight"]},
            {
                "lastInFlight": {"mode": "drain", "kvCacheMode": "persist", "staging": "inPlace"},
                "lastStallMilliseconds": None,
            },
            id="no-staging-no-pause",
        ),
        pytest.param({}, {"lastInFlight": None, "lastStallMilliseconds": None}, id="nothing-reported-clears"),
    ],
)
def test_the_fleet_keeps_how_its_last_refit_treated_the_sequences_in_flight(report: Object, expected: Object) -> None:
    assert refit_status.last_in_flight(report) == expected
    succeeded = refit_status.Outcome("Succeeded", "done", phases=[], duration=7, version=4, serving=(0,), report=report)
    patch = refit_status.released_fleet(fleet_body({"active": "tiny-v4"}), "tiny-v4", succeeded, NOW)
    assert patch is not None and {key: patch["refit"][key] for key in expected} == expected
