"""A shard whose catch-up from the fleet's checkpoint keeps failing is retried after growing delays
(10 s, 20 s, ... 5 min), each failure reported once, instead of at every reconcile. The delays
themselves (pure) and :func:`megafleet.reconcile.catch_up.start` driven by a stand-in for the agents'
HTTP client (the real client and agents are exercised by tests/e2e/test_refit_recovery.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, backoff, desired, settings
from megafleet.api import v1alpha1
from megafleet.fleet_state import pods
from megafleet.reconcile import catch_up, context
from megafleet_protocol import agent_api


def test_delays_double_up_to_the_cap_and_a_failure_counts_once() -> None:
    delays = backoff.Backoff(first_seconds=10, most_seconds=35)
    assert [delays.delay(n) for n in (1, 2, 3, 4)] == [10, 20, 35, 35]
    assert delays.wait("k", failed=False, now=0) == (0.0, None)
    assert delays.wait("k", failed=True, now=100) == (10.0, 1)  # first failure seen: wait 10 s
    assert delays.wait("k", failed=True, now=105) == (5.0, None)  # the same failure, still waiting
    assert delays.wait("k", failed=True, now=110) == (0.0, None)  # due: run again
    assert delays.wait("k", failed=True, now=111) == (20.0, 2)  # that run failed too: 20 s
    assert delays.wait("k", failed=False, now=200) == (0.0, None) and delays.failures("k") == 0  # it worked
    delays.wait("other", failed=True, now=0)
    delays.forget(lambda key: key != "other")
    assert delays.failures("other") == 0


IDLE_FIELDS: dict[str, Any] = {
    "transport": None,
    "rank": None,
    "worldSize": None,
    "phases": [],
    "durationMilliseconds": None,
    "bytesReceived": 0,
    "buckets": 0,
    "tensorsWritten": 0,
    "timedOut": False,
    "dirty": False,
    "state": "stale",
    "weightVersion": None,
}
"""The status fields the catch-up does not look at."""


class StandInAgents(agent_fakes.Agents):
    """The agents' client as :func:`catch_up.start` calls it: each pod's refit status, and the
    checkpoint refits it starts (a started one runs, then fails when ``failing``)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[str] = []
        self.phase = "idle"
        self.failing = True

    async def refit_status(self, pod_ip: str, token: str) -> agent_api.RefitStatusResponse:
        if self.phase == "running" and self.failing:
            self.phase = "failed"  # the attempt ran and failed before this look
        return agent_api.RefitStatusResponse.model_validate(
            {"version": 3, "phase": self.phase, "source": "checkpoint", "error": "no such file", **IDLE_FIELDS}
        )

    async def refit_start(self, pod_ip: str, token: str, body: agent_api.RefitRequest) -> None:
        assert isinstance(body, agent_api.CheckpointRefitRequest)
        assert (body.version, body.path) == (3, "/ckpt/v3")
        self.started.append(pod_ip)
        self.phase = "running"


def test_a_failing_catch_up_is_retried_after_growing_delays_and_reported_once_per_failure() -> None:
    spec = v1alpha1.MegatronGenerationSpec.model_validate({"model": {"source": "/models/m"}})
    fleet = desired.ParsedFleet("gen", "rl", "uid-1", 1, spec)
    pod = {
        "metadata": {"name": "gen-s0-p0", "labels": {"megafleet.dev/shard": "0"}},
        "status": {"podIP": "10.0.0.5", "phase": "Running"},
    }
    client = StandInAgents()
    events: list[tuple[str, str]] = []
    api = kube_fakes.Api()
    runtime = context.Runtime.of(api, client, settings.OperatorSettings())
    assert (runtime.catch_up.first_seconds, runtime.catch_up.most_seconds) == (10, 300)
    ctx = context.FleetContext(
        runtime,
        {},
        fleet,
        lambda kind, reason, message: events.append((reason, message)),
        status={"refit": {"currentVersion": 3, "currentCheckpoint": "/ckpt/v3"}},
        shards=pods.Shards({0: [pods.parse(pod, clique_label="clique")]}, set()),
        reports={0: [agent_client.AgentState(state="stale", weight_version=None)]},
    )
    now = [0.0]

    def reconcile_at(seconds: float) -> None:
        now[0] = seconds
        asyncio.run(catch_up.start(ctx, clock=lambda: now[0]))

    reconcile_at(0)  # stale, nothing ran yet: start at once
    assert client.started == ["10.0.0.5"] and events[-1][0] == "ShardCatchingUp"
    reconcile_at(5)  # it failed: reported, next try in 10 s
    assert len(client.started) == 1 and events[-1][0] == "CatchUpFailed" and "next try in 10 s" in events[-1][1]
    assert "no such file" in events[-1][1]
    reconcile_at(9)  # still waiting, nothing new to say
    assert len(client.started) == 1 and len(events) == 2
    reconcile_at(15)  # due: tried again
    assert len(client.started) == 2 and events[-1][0] == "ShardCatchingUp"
    reconcile_at(20)  # failed again: 20 s
    assert len(client.started) == 2 and "2 in a row" in events[-1][1] and "next try in 20 s" in events[-1][1]
    reconcile_at(39)
    assert len(client.started) == 2
    client.failing = False
    reconcile_at(41)
    assert len(client.started) == 3 and client.phase == "running"
    assert not api.writes and not api.reads  # the catch-up only asks the agents
