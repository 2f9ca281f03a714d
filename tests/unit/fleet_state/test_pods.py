"""The typed pod view: parsed once from pod JSON, grouped by shard in pod order."""

from __future__ import annotations

from typing import Any

import pytest

from megafleet import names
from megafleet.fleet_state import pods

CLIQUE = "nvidia.com/gpu.clique"


def raw(
    name: str = "gen-s1-p0",
    *,
    shard: str = "1",
    index: str | None = "0",
    status: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    labels = {names.LABEL_SHARD: shard}
    if index is not None:
        labels[names.LABEL_POD_INDEX] = index
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if annotations is not None:
        metadata["annotations"] = annotations
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": metadata, "spec": spec or {}, "status": status or {}}


def pinned(*expressions: tuple[str, str]) -> dict[str, Any]:
    terms = [{"matchExpressions": [{"key": k, "operator": "In", "values": [v]} for k, v in expressions]}]
    return {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
    }


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        (
            raw(),
            pods.Pod("gen-s1-p0", 1, 0, "", "", "", None, None, None, False),
        ),
        (
            raw(
                "gen-s2-p3",
                shard="2",
                index="3",
                status={"phase": "Running", "podIP": "127.0.0.9"},
                spec={"nodeName": "n4", **pinned((CLIQUE, "c1"), ("kubernetes.io/hostname", "n4"))},
                annotations={names.ANNOTATION_TEMPLATE_HASH: "abc"},
            ),
            pods.Pod("gen-s2-p3", 2, 3, "Running", "127.0.0.9", "n4", "n4", "c1", "abc", False),
        ),
        (
            raw(index=None, status={"phase": "Pending"}, spec=pinned(("kubernetes.io/hostname", "n7"))),
            pods.Pod("gen-s1-p0", 1, 0, "Pending", "", "", "n7", None, None, False),
        ),
        (raw(deleting=True), pods.Pod("gen-s1-p0", 1, 0, "", "", "", None, None, None, True)),
    ],
    ids=["fresh", "running-in-clique", "pinned-no-index-label", "deleting"],
)
def test_parse(pod: dict[str, Any], expected: pods.Pod) -> None:
    assert pods.parse(pod, clique_label=CLIQUE) == expected


def engine(*, state: dict[str, Any] | None = None, last: dict[str, Any] | None = None, restarts: int = 0) -> Any:
    return {"name": "engine", "state": state or {}, "lastState": last or {}, "restartCount": restarts}


MESSAGE = "invalid configuration: MEGAFLEET_REFIT_WAIT_SECONDS must be at least 0, got -5"


@pytest.mark.parametrize(
    ("status", "reason", "restarts"),
    [
        ({"phase": "Running", "containerStatuses": [engine(state={"running": {}})]}, None, 0),
        (
            {
                "phase": "Running",
                "containerStatuses": [engine(last={"terminated": {"exitCode": 2, "message": MESSAGE}}, restarts=3)],
            },
            MESSAGE,
            3,
        ),
        (
            {
                "phase": "Failed",
                "message": "engine exited",
                "containerStatuses": [engine(state={"terminated": {"exitCode": 2, "message": MESSAGE + "\n"}})],
            },
            MESSAGE,
            0,
        ),
        (
            {
                "phase": "Running",
                "containerStatuses": [
                    engine(last={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}, restarts=1)
                ],
            },
            "OOMKilled (exit code 137)",
            1,
        ),
        (
            {
                "phase": "Running",
                "containerStatuses": [engine(last={"terminated": {"exitCode": 0, "reason": "Completed"}}, restarts=1)],
            },
            None,
            1,
        ),
        (
            {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."},
            "The node was low on resource: memory.",
            0,
        ),
        (
            {
                "phase": "Running",
                "containerStatuses": [engine(last={"terminated": {"exitCode": 1, "message": "x" * 5000}})],
            },
            "x" * pods.REASON_CHARACTERS,
            0,
        ),
    ],
    ids=["running", "restarted-with-message", "ended-with-message", "oom-killed", "exited-cleanly", "evicted", "cut"],
)
def test_why_an_engine_exited_is_read_from_its_termination_message(
    status: dict[str, Any], reason: str | None, restarts: int
) -> None:
    pod = pods.parse(raw(status=status), clique_label=CLIQUE)
    assert (pod.exit_reason, pod.engine_restarts) == (reason, restarts)


@pytest.mark.parametrize(
    ("phase", "ip", "running", "ended"),
    [
        ("Running", "127.0.0.2", True, False),
        ("Running", "", False, False),
        ("Pending", "127.0.0.2", False, False),
        ("Failed", "127.0.0.2", False, True),
        ("Succeeded", "", False, True),
    ],
    ids=["running", "running-without-ip", "pending", "failed", "succeeded"],
)
def test_running_and_ended(phase: str, ip: str, running: bool, ended: bool) -> None:
    pod = pods.parse(raw(status={"phase": phase, "podIP": ip}), clique_label=CLIQUE)
    assert (pod.running, pod.ended) == (running, ended)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"nodeName": "n1", **pinned(("kubernetes.io/hostname", "n2"))}, "n1"),
        (pinned(("kubernetes.io/hostname", "n2")), "n2"),
        ({}, ""),
    ],
    ids=["bound", "pinned", "nowhere"],
)
def test_placed_on_is_the_bound_else_the_pinned_node(spec: dict[str, Any], expected: str) -> None:
    assert pods.parse(raw(spec=spec), clique_label=CLIQUE).placed_on == expected


def test_shards_group_in_pod_order_and_a_deleting_pod_makes_its_shard_terminating() -> None:
    found = [
        pods.parse(raw("gen-s0-p1", shard="0", index="1"), clique_label=CLIQUE),
        pods.parse(raw("gen-s0-p0", shard="0", index="0"), clique_label=CLIQUE),
        pods.parse(raw("gen-s1-p0", shard="1", index="0", deleting=True), clique_label=CLIQUE),
    ]
    shards = pods.Shards.of(found)
    assert {shard: [pod.name for pod in members] for shard, members in shards.pods.items()} == {
        0: ["gen-s0-p0", "gen-s0-p1"]
    }
    assert shards.terminating == {1}
    taken = shards.take(0)
    assert [pod.name for pod in taken] == ["gen-s0-p0", "gen-s0-p1"]
    assert shards.pods == {} and shards.terminating == {0, 1}
