"""The Ready, Degraded and WeightsCurrent conditions, as the reconcile and a settled refit build them."""

from __future__ import annotations

from typing import Any

import pytest

from megafleet import conditions
from megafleet.fleet_state import readiness

NOW = "2026-12-01T00:00:00Z"


def condition(found: list[conditions.Condition], kind: str) -> tuple[str, str, str]:
    item = conditions.find(found, kind)
    assert item is not None and item["observedGeneration"] == 3
    return item["status"], item["reason"], item["message"]


@pytest.mark.parametrize(
    ("ready_shards", "ready_expected", "degraded_expected"),
    [
        (2, ("True", "AllShardsReady", "2 of 2 shards ready"), ("False", "AsDesired", "")),
        (
            1,
            ("False", "ShardsNotReady", "1 of 2 shards ready"),
            ("True", "ShardsUnavailable", "1 of 2 shards not ready"),
        ),
        (0, ("False", "ShardsNotReady", "0 of 2 shards ready"), ("False", "AsDesired", "")),
    ],
    ids=["all", "some", "none"],
)
def test_ready_and_degraded(
    ready_shards: int, ready_expected: tuple[str, str, str], degraded_expected: tuple[str, str, str]
) -> None:
    found = readiness.ready_condition([], ready_shards, 2, generation=3, now=NOW)
    assert condition(found, conditions.READY) == ready_expected
    found = readiness.degraded(found, ready_shards, 2, generation=3, now=NOW)
    assert condition(found, conditions.DEGRADED) == degraded_expected


@pytest.mark.parametrize(
    ("ready_shards", "failing", "expected"),
    [
        (
            0,
            ["shard 0: pods ended: gen-s0-p0 (OOMKilled (exit code 137))"],
            (
                "True",
                "ShardsFailing",
                "1 of 2 shards not ready after restarts: shard 0: pods ended: gen-s0-p0 (OOMKilled (exit code 137))",
            ),
        ),
        (
            1,
            ["shard 1: Starting"],
            ("True", "ShardsFailing", "1 of 2 shards not ready after restarts: shard 1: Starting"),
        ),
        (0, [], ("False", "AsDesired", "")),
    ],
    ids=["none-ready-after-restarts", "some-ready", "none-ready-first-start"],
)
def test_a_shard_not_ready_after_restarts_is_never_as_desired(
    ready_shards: int, failing: list[str], expected: tuple[str, str, str]
) -> None:
    found = readiness.degraded([], ready_shards, 2, failing=failing, generation=3, now=NOW)
    assert condition(found, conditions.DEGRADED) == expected


def test_the_degraded_message_is_bounded() -> None:
    failing = [f"shard {k}: " + "x" * 1000 for k in range(100)]
    found = readiness.degraded([], 0, 100, failing=failing, generation=3, now=NOW)
    message = condition(found, conditions.DEGRADED)[2]
    assert len(message) == readiness.MESSAGE_CHARACTERS and message.startswith("100 of 100 shards not ready after")


def entries(*versions: int | None) -> list[dict[str, Any]]:
    return [{"index": i, **({"weightVersion": v} if v is not None else {})} for i, v in enumerate(versions)]


@pytest.mark.parametrize(
    ("shard_entries", "refit", "expected"),
    [
        (entries(1, 1), {}, ("True", "Current", "every shard serves version 1")),
        (entries(1, 2), {}, ("False", "Behind", "not every shard has weights yet")),
        (entries(1, None), {}, ("False", "Behind", "not every shard has weights yet")),
        ([], {}, ("False", "Behind", "not every shard has weights yet")),
        (entries(4, 4), {"currentVersion": 4}, ("True", "Current", "every shard serves version 4")),
        (entries(4, 3, None), {"currentVersion": 4}, ("False", "Behind", "shards [1, 2] are not at version 4")),
        (entries(4, 4), {"active": "r5", "currentVersion": 4}, ("False", "Refitting", "refit r5 is running")),
    ],
    ids=["same", "mixed", "one-without", "no-shards", "at-current", "behind-current", "refitting"],
)
def test_weights_current(
    shard_entries: list[dict[str, Any]], refit: dict[str, Any], expected: tuple[str, str, str]
) -> None:
    found = readiness.weights_current([], shard_entries, refit, generation=3, now=NOW)
    assert condition(found, conditions.WEIGHTS_CURRENT) == expected


def test_reconciling_is_true_while_changes_are_applied_and_false_once_they_are() -> None:
    found = readiness.reconciling([], ["spec.replicas 3", "a pod template change"], generation=3, now=NOW)
    assert condition(found, conditions.RECONCILING) == (
        "True",
        "Progressing",
        "applying spec.replicas 3 and a pod template change",
    )
    settled = readiness.reconciling(found, [], generation=3, now=NOW)
    assert condition(settled, conditions.RECONCILING) == ("False", "AsDesired", "")
