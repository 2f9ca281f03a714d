"""Fleet status from observations: shard phases from agent reports, shard entries, conditions."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from megafleet import agent_client, conditions, desired
from megafleet.api import v1alpha1
from megafleet.fleet_state import patches, pods
from megafleet.reconcile import shards as shard_steps
from megafleet.reconcile import status

NOW = "2026-12-01T00:00:00Z"
LATER = "2026-12-01T00:01:00Z"


def fleet(replicas: int = 2, generation: int = 3) -> desired.ParsedFleet:
    spec = v1alpha1.MegatronGenerationSpec.model_validate({"model": {"source": "/models/m"}, "replicas": replicas})
    return desired.ParsedFleet("gen", "rl", "uid-1", generation, spec)


def ready(version: int | None = 1, address: str | None = None) -> agent_client.AgentState:
    return agent_client.AgentState(state="ready", weight_version=version, served_address=address)


def pod(shard: int, index: int = 0, ip: str = "127.0.0.2", clique: str | None = None) -> pods.Pod:
    return pods.Pod(f"gen-s{shard}-p{index}", shard, index, "Running", ip, f"n{index}", None, clique, "h", False)


def condition(found: list[conditions.Condition], kind: str) -> tuple[str, str, str]:
    item = conditions.find(found, kind)
    assert item is not None and item["observedGeneration"] == 3
    return item["status"], item["reason"], item["message"]


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        ([], ("Ready", None, None)),
        ([ready(4), ready(4)], ("Ready", None, 4)),
        ([ready(), None], ("Starting", None, None)),
        ([ready(), agent_client.AgentState(error="unreachable")], ("Starting", "unreachable", None)),
        ([ready(), agent_client.AgentState(state="loading")], ("Loading", None, None)),
        ([agent_client.AgentState(state="stale", weight_version=2, last_error="behind")], ("Stale", "behind", 2)),
        ([ready(), agent_client.AgentState(state="suspended", weight_version=1)], ("Refitting", None, 1)),
        (
            [agent_client.AgentState(state="failed", last_error="oom"), agent_client.AgentState(state="loading")],
            ("Loading", None, None),
        ),
        ([agent_client.AgentState(state="failed", last_error="oom"), ready()], ("Failed", "oom", None)),
    ],
    ids=[
        "no-pods",
        "all-ready",
        "one-not-running",
        "one-unreachable",
        "one-loading",
        "stale",
        "suspended-is-refitting",
        "loading-before-failed",
        "failed",
    ],
)
def test_raw_phase(reports: list[agent_client.AgentState | None], expected: tuple[str, str | None, int | None]) -> None:
    assert status.raw_phase(reports) == expected


@pytest.mark.parametrize(
    ("reports", "current", "expected"),
    [
        ([ready(4)], None, ("Ready", None, 4)),
        ([ready(4)], 4, ("Ready", None, 4)),
        ([ready(3)], 4, ("Stale", "serves version 3, the fleet is at 4", 3)),
        (
            [agent_client.AgentState(state="suspended", weight_version=3)],
            4,
            ("Stale", "serves version 3, the fleet is at 4", 3),
        ),
        (
            [agent_client.AgentState(state="loading")],
            4,
            ("Stale", "has no weights yet, the fleet is at version 4", None),
        ),
        ([agent_client.AgentState(state="loading")], None, ("Loading", None, None)),
        ([None], 4, ("Starting", None, None)),
    ],
    ids=["no-current", "at-current", "behind", "refitting-behind", "loading-after-refit", "loading", "starting"],
)
def test_shard_phase_against_the_current_version(
    reports: list[agent_client.AgentState | None], current: int | None, expected: tuple[str, str | None, int | None]
) -> None:
    assert status.shard_phase(reports, current) == expected


def entry(members: list[pods.Pod] | None, **overrides: Any) -> dict[str, Any]:
    """:func:`status.shard_entry` of shard 0 with ``overrides`` of what was seen, the fleet at no
    current version and 5 restarts allowed unless overridden."""
    current_version = overrides.pop("current_version", None)
    seen = status.ShardSeen(members, **overrides)
    return status.shard_entry(0, seen, current_version=current_version, max_restarts=5)


@pytest.mark.parametrize(
    ("members", "overrides", "expected"),
    [
        (None, {}, {"index": 0, "restarts": 0, "phase": "Pending"}),
        (None, {"terminating": True}, {"index": 0, "restarts": 0, "phase": "Draining"}),
        (
            None,
            {"unplaced": "no clique has 8 GPUs", "restarts": (1, "pods gone")},
            {"index": 0, "restarts": 1, "phase": "Pending", "lastError": "no clique has 8 GPUs"},
        ),
        (
            None,
            {"restarts": (6, "pods ended: p0")},
            {
                "index": 0,
                "restarts": 6,
                "phase": "Failed",
                "lastError": "gave up after 5 restarts; last: pods ended: p0",
            },
        ),
        (
            [pod(0, 0, clique="c1"), pod(0, 1, clique="c1")],
            {"reports": [ready(2), ready(2)], "restarts": (2, "pods gone")},
            {
                "index": 0,
                "restarts": 2,
                "pods": ["gen-s0-p0", "gen-s0-p1"],
                "nodes": ["n0", "n1"],
                "clique": "c1",
                "phase": "Ready",
                "weightVersion": 2,
            },
        ),
        (
            [pod(0)],
            {"reports": [None], "restarts": (1, "pods gone")},
            {
                "index": 0,
                "restarts": 1,
                "pods": ["gen-s0-p0"],
                "nodes": ["n0"],
                "phase": "Starting",
                "lastError": "pods gone",
            },
        ),
        (
            [pod(0)],
            {"reports": [ready(1)], "current_version": 2},
            {
                "index": 0,
                "restarts": 0,
                "pods": ["gen-s0-p0"],
                "nodes": ["n0"],
                "phase": "Stale",
                "weightVersion": 1,
                "lastError": "serves version 1, the fleet is at 2",
            },
        ),
    ],
    ids=["pending", "draining", "unplaced", "gave-up", "ready-recovered", "starting-keeps-error", "stale"],
)
def test_shard_entry(members: list[pods.Pod] | None, overrides: dict[str, Any], expected: dict[str, Any]) -> None:
    assert entry(members, **overrides) == expected


def test_a_failed_shard_keeps_the_same_entry_at_every_reconcile() -> None:
    """Each reconcile reads lastError back from the status (once, it grew "gave up after 5
    restarts; last: gave up after ..." at every pass, so status was written forever)."""
    first = entry(None, restarts=(6, "pods ended: p0"))
    again = entry(None, restarts=(6, first["lastError"]))
    third = entry(None, restarts=(6, again["lastError"]))

    assert first == again == third
    assert first["lastError"] == "gave up after 5 restarts; last: pods ended: p0"


@pytest.mark.parametrize(
    ("unplaced", "expected"),
    [
        ({}, ("True", "AllShardsPlaced", "2 shards placed")),
        (
            {1: "shard 1: no node", 0: "shard 0: no node"},
            ("False", "Unschedulable", "shard 0: no node; shard 1: no node"),
        ),
    ],
    ids=["placed", "unschedulable"],
)
def test_placed(unplaced: dict[int, str], expected: tuple[str, str, str]) -> None:
    assert condition(status.placed([], unplaced, 2, generation=3, now=NOW), conditions.PLACED) == expected


@pytest.mark.parametrize(
    ("reserved", "served", "expected"),
    [
        ([], [], ("False", "NoFrontendServing", "no frontend reports an address yet")),
        (["shard 0: a:1"], ["shard 0: a:1"], ("True", "Verified", "1 frontends serve where their endpoints point")),
        (["shard 0: a:1"], ["shard 0: b:1"], ("False", "Mismatch", "reserved: shard 0: a:1; served: shard 0: b:1")),
    ],
    ids=["none-serving", "verified", "mismatch"],
)
def test_endpoints_verified(reserved: list[str], served: list[str], expected: tuple[str, str, str]) -> None:
    found = status.endpoints_verified([], reserved, served, generation=3, now=NOW)
    assert condition(found, conditions.ENDPOINTS_VERIFIED) == expected


def test_a_mismatch_is_reported_once_and_a_verified_address_not_at_all() -> None:
    shards = pods.Shards({0: [pod(0, ip="127.0.0.2")]}, set())
    wrong: pods.Reports = {0: [ready(1, address="127.0.0.3:8000")]}
    first, warning = status.verify_addresses({}, shards, wrong, port=8000, generation=3, now=NOW)
    assert warning == "reserved: shard 0: 127.0.0.2:8000; served: shard 0: 127.0.0.3:8000"
    again, warning = status.verify_addresses(first, shards, wrong, port=8000, generation=3, now=LATER)
    assert warning is None and again == first  # no new transition, no new timestamp
    right: pods.Reports = {0: [ready(1, address="127.0.0.2:8000")]}
    verified, warning = status.verify_addresses(again, shards, right, port=8000, generation=3, now=LATER)
    assert warning is None and condition(verified["conditions"], conditions.ENDPOINTS_VERIFIED)[1] == "Verified"


def test_invalid_spec_sets_invalid_and_not_ready_and_a_valid_one_clears_it() -> None:
    invalid = status.invalid({"replicas": 2}, "spec.replicas: too many", generation=3, now=NOW)
    assert invalid["observedGeneration"] == 3 and invalid["replicas"] == 2
    assert condition(invalid["conditions"], conditions.INVALID_SPEC) == (
        "True",
        "InvalidSpec",
        "spec.replicas: too many",
    )
    assert condition(invalid["conditions"], conditions.READY) == ("False", "InvalidSpec", "spec.replicas: too many")
    endpoint = v1alpha1.Endpoint(
        shard=0, url="http://10.96.0.10:8000/v1", dns_url="http://f-f0.rl.svc:8000/v1", service="f-f0"
    )
    valid = status.with_endpoints(invalid, fleet(), [endpoint], now=LATER)
    assert condition(valid["conditions"], conditions.INVALID_SPEC) == ("False", "Valid", "")
    assert condition(valid["conditions"], conditions.ENDPOINTS_RESERVED) == (
        "True",
        "ServicesCreated",
        "1 frontend endpoints reserved",
    )
    assert valid["endpoints"] == [endpoint.model_dump(mode="json", by_alias=True)]
    assert valid["selector"] == fleet().selector


def test_observed_counts_shards_and_sets_every_condition_and_is_stable() -> None:
    shards = pods.Shards({0: [pod(0)], 1: [pod(1)]}, set())
    reports: pods.Reports = {0: [ready(2)], 1: [None]}
    seen = status.FleetSeen(shards, unplaced={}, restarts={}, reports=reports)
    first = status.observed({"refit": {"currentVersion": 2}}, fleet(), seen, max_restarts=5, now=NOW)
    assert (first["observedGeneration"], first["replicas"], first["readyReplicas"]) == (3, 2, 1)
    assert first["weightVersion"] == 2
    assert [entry["phase"] for entry in first["shards"]] == ["Ready", "Starting"]
    assert [c["type"] for c in first["conditions"]] == [
        conditions.PLACED,
        conditions.READY,
        conditions.DEGRADED,
        conditions.WEIGHTS_CURRENT,
    ]
    again = status.observed(first, fleet(), seen, max_restarts=5, now=LATER)
    assert patches.unchanged(first, again)  # nothing changed: nothing to write


def test_observed_drops_the_weight_version_when_shards_disagree() -> None:
    shards = pods.Shards({0: [pod(0)], 1: [pod(1)]}, set())
    reports: pods.Reports = {0: [ready(2)], 1: [ready(3)]}
    found = status.observed(
        {"weightVersion": 2}, fleet(), status.FleetSeen(shards, {}, {}, reports), max_restarts=5, now=NOW
    )
    assert "weightVersion" not in found


EXITED = "invalid configuration: MEGAFLEET_REFIT_WAIT_SECONDS must be at least 0, got -5"


def crashing(shard: int, restarts: int, reason: str | None = EXITED) -> pods.Pod:
    """A pod whose engine the kubelet restarted ``restarts`` times, last for ``reason``."""
    return dataclasses.replace(pod(shard), exit_reason=reason, engine_restarts=restarts)


def test_a_shard_whose_engine_keeps_exiting_says_why_and_makes_the_fleet_degraded() -> None:
    """0 of 1 shards ready and its engine restarted: never "AsDesired". The shard's lastError, the
    Degraded message and one Event per new exit carry the engine's termination message."""
    unreachable = agent_client.AgentState(error="agent at 127.0.0.2:8471 unreachable: ClientConnectorError")
    seen = status.FleetSeen(pods.Shards({0: [crashing(0, 3)]}, set()), {}, {}, {0: [unreachable]})
    found = status.observed({}, fleet(replicas=1), seen, max_restarts=5, now=NOW)

    [shard] = found["shards"]
    assert (shard["phase"], shard["lastError"]) == ("Starting", f"gen-s0-p0 (restarted 3 times): {EXITED}")
    assert condition(found["conditions"], conditions.READY)[0] == "False"
    assert condition(found["conditions"], conditions.DEGRADED) == (
        "True",
        "ShardsFailing",
        f"1 of 1 shards not ready after restarts: shard 0: gen-s0-p0 (restarted 3 times): {EXITED}",
    )
    assert status.engine_exits({}, found, seen) == [f"shard 0: gen-s0-p0 (restarted 3 times): {EXITED}"]
    again = status.observed(found, fleet(replicas=1), seen, max_restarts=5, now=LATER)
    assert patches.unchanged(found, again) and status.engine_exits(found, again, seen) == []
    restarted = status.FleetSeen(pods.Shards({0: [crashing(0, 4)]}, set()), {}, {}, {0: [unreachable]})
    after = status.observed(again, fleet(replicas=1), restarted, max_restarts=5, now=LATER)
    assert status.engine_exits(again, after, restarted) == [f"shard 0: gen-s0-p0 (restarted 4 times): {EXITED}"]


@pytest.mark.parametrize(
    ("members", "restarts", "reports", "expected"),
    [
        (None, (3, f"pods ended: gen-s0-p0 ({EXITED})"), [], ("True", "ShardsFailing")),
        (None, (6, "pods ended: gen-s0-p0"), [], ("True", "ShardsFailing")),
        ([pod(0)], (0, None), [None], ("False", "AsDesired")),
        ([pod(0)], (1, "pods gone"), [ready(1)], ("False", "AsDesired")),
        ([crashing(0, 2, reason="OOMKilled (exit code 137)")], (0, None), [ready(1)], ("False", "AsDesired")),
        (
            [crashing(0, 1, reason="OOMKilled (exit code 137)")],
            (0, None),
            [agent_client.AgentState(state="loading")],
            ("True", "ShardsFailing"),
        ),
        (
            [pod(0)],
            (1, "pods gone"),
            [agent_client.AgentState(state="suspended", weight_version=1)],
            ("False", "AsDesired"),
        ),
    ],
    ids=[
        "re-placed",
        "given-up",
        "first-start",
        "recovered",
        "restarted-but-serving",
        "reloading-after-oom",
        "refitting",
    ],
)
def test_only_shards_not_ready_after_restarts_make_a_fleet_with_none_ready_degraded(
    members: list[pods.Pod] | None,
    restarts: tuple[int, str | None],
    reports: list[agent_client.AgentState | None],
    expected: tuple[str, str],
) -> None:
    shards = pods.Shards({0: members} if members else {}, set())
    seen = status.FleetSeen(shards, {}, {0: restarts}, {0: reports} if members else {})
    found = status.observed({}, fleet(replicas=1), seen, max_restarts=5, now=NOW)
    assert condition(found["conditions"], conditions.DEGRADED)[:2] == expected


def test_a_restarted_shard_whose_agent_does_not_answer_yet_keeps_why_it_restarted() -> None:
    unreachable = agent_client.AgentState(error="agent at 127.0.0.2:8471 unreachable: ClientConnectorError")
    replaced = entry([pod(0)], reports=[unreachable], restarts=(1, f"pods ended: gen-s0-p0 ({EXITED})"))
    assert (replaced["phase"], replaced["lastError"]) == ("Starting", f"pods ended: gen-s0-p0 ({EXITED})")
    fresh = entry([pod(0)], reports=[unreachable])
    assert fresh["lastError"] == "agent at 127.0.0.2:8471 unreachable: ClientConnectorError"


def test_an_ended_pod_says_why_its_engine_exited_in_the_restart_reason() -> None:
    ended = dataclasses.replace(pod(0), phase="Failed", exit_reason=EXITED)
    layout = fleet().layout
    assert shard_steps.broken([ended], layout, "h") == f"pods ended: gen-s0-p0 ({EXITED})"
    assert shard_steps.broken([dataclasses.replace(pod(0), phase="Failed")], layout, "h") == "pods ended: gen-s0-p0"


def test_a_fleet_that_cannot_be_acted_on_is_stalled_until_its_spec_is_valid() -> None:
    """kstatus reads Stalled=True as Failed: a GitOps health check fails at once instead of timing out."""
    invalid = status.invalid({}, "spec.replicas: too many", generation=3, now=NOW)
    assert condition(invalid["conditions"], conditions.STALLED) == ("True", "InvalidSpec", "spec.replicas: too many")
    valid = status.with_endpoints(invalid, fleet(), [], now=LATER)
    assert condition(valid["conditions"], conditions.STALLED) == ("False", "AsDesired", "")
