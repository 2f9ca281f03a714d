"""Catch-up from a peer: which source a shard behind the fleet's version takes (a table over the pure
choice), and :func:`megafleet.reconcile.catch_up.start` driving it against stand-ins for the agents'
HTTP client: a peer first, the checkpoint when the peer copy failed, the megatron backend on the
checkpoint only, the Events naming the source (the real agents are exercised by
tests/refit/test_refit_peer.py and tests/e2e/test_catch_up_from_peer.py)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, desired, settings
from megafleet.api import v1alpha1
from megafleet.fleet_state import pods
from megafleet.reconcile import catch_up, context, peer_catch_up
from megafleet_protocol import agent_api, ports

Peer, Checkpoint = peer_catch_up.Peer, peer_catch_up.Checkpoint


@pytest.mark.parametrize(
    ("shard", "peers", "checkpoint", "backend", "waits", "expected"),
    [
        (2, [0, 1], None, "transformers", (0, 0), Peer(0)),  # after a trainer's refit: only peers hold it
        (2, [0, 1], "/ckpt/v5", "transformers", (0, 0), Peer(0)),  # a peer first, checkpoint or not
        (3, [0, 1], "/ckpt/v5", "transformers", (0, 0), Peer(1)),  # several catching up share the peers
        (2, [0, 1], "/ckpt/v5", "transformers", (10, 0), Checkpoint("/ckpt/v5")),  # the peer copy failed
        (2, [0, 1], None, "transformers", (10, 0), None),  # ... and no checkpoint: Stale until it is due
        (2, [], "/ckpt/v5", "transformers", (0, 0), Checkpoint("/ckpt/v5")),  # no Ready peer
        (2, [], None, "transformers", (0, 0), None),  # neither: Stale until the next refit
        (2, [0, 1], "/ckpt/v5", "transformers", (10, 20), None),  # both failed lately: wait
        (2, [0, 1], "/ckpt/v5", "megatron", (0, 0), Checkpoint("/ckpt/v5")),  # sharded weights: no peer copy
        (2, [0, 1], None, "megatron", (0, 0), None),
    ],
)
def test_the_source_a_shard_catches_up_from(
    shard: int,
    peers: list[int],
    checkpoint: str | None,
    backend: Any,
    waits: tuple[float, float],
    expected: peer_catch_up.Choice,
) -> None:
    assert peer_catch_up.choose(shard, peers, checkpoint, backend=backend, waits=waits) == expected


def test_the_peers_are_the_shards_ready_at_the_current_version() -> None:
    ready = agent_client.AgentState(state="ready", weight_version=5)
    reports: pods.Reports = {
        0: [ready, ready],
        1: [ready, agent_client.AgentState(state="ready", weight_version=4)],
        2: [ready, None],
        3: [ready, agent_client.AgentState(state="suspended", weight_version=5)],
        4: [agent_client.AgentState(error="unreachable")],
        5: [ready],
    }
    assert peer_catch_up.current_peers(reports, 5) == [0, 5]


STATUS_FIELDS: dict[str, Any] = {
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


class StandInAgents(agent_fakes.Agents):
    """The agents as the catch-up calls them: the new shard's refit status (its last catch-up runs,
    then fails when ``failing``), the peers' copy status, and the calls it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, Any]] = []
        self.phase = "idle"
        self.source: str | None = None
        self.failing = True
        self.peer_phase: Literal["idle", "sending", "sent", "failed"] = "idle"
        self.peer_silent = False  # the peer's agent does not answer GET /v1/peer/status

    async def refit_status(self, pod_ip: str, token: str) -> agent_api.RefitStatusResponse:
        if self.phase == "running" and self.failing:
            self.phase = "failed"
        version = None if self.phase == "idle" else 5
        body = {"version": version, "phase": self.phase, "source": self.source, "error": "peer gone", **STATUS_FIELDS}
        return agent_api.RefitStatusResponse.model_validate(body)

    async def peer_status(self, pod_ip: str, token: str) -> agent_api.PeerSendStatus | None:
        return None if self.peer_silent else agent_api.PeerSendStatus(phase=self.peer_phase)

    async def peer_send(self, pod_ip: str, token: str, body: agent_api.PeerSendRequest) -> None:
        self.calls.append(("send", pod_ip, body))

    async def refit_start(self, pod_ip: str, token: str, body: agent_api.RefitRequest) -> None:
        self.calls.append(("receive", pod_ip, body))
        self.phase = "running"
        self.source = "peer" if isinstance(body, agent_api.PeerRefitRequest) else "checkpoint"


def pod(shard: int) -> pods.Pod:
    raw = {
        "metadata": {"name": f"gen-s{shard}-p0", "labels": {"megafleet.dev/shard": str(shard)}},
        "status": {"podIP": f"10.0.0.{shard + 1}", "phase": "Running"},
    }
    return pods.parse(raw, clique_label="clique")


def fleet_context(
    agents: StandInAgents,
    events: list[tuple[str, str]],
    *,
    checkpoint: str | None,
    backend: str = "transformers",
    catch_up_from: str = "peer",
) -> context.FleetContext:
    spec = v1alpha1.MegatronGenerationSpec.model_validate(
        {
            "model": {"source": "/models/m"},
            "engine": {"backend": backend},
            "replicas": 3,
            "weights": {"catchUp": catch_up_from},
        }
    )
    runtime = context.Runtime.of(kube_fakes.Api(), agents, settings.OperatorSettings())
    ready = agent_client.AgentState(state="ready", weight_version=5)
    return context.FleetContext(
        runtime,
        {},
        desired.ParsedFleet("gen", "rl", "uid-1", 1, spec),
        lambda kind, reason, message: events.append((reason, message)),
        status={"refit": {"currentVersion": 5, "currentCheckpoint": checkpoint}},
        shards=pods.Shards({shard: [pod(shard)] for shard in range(3)}, set()),
        reports={0: [ready], 1: [ready], 2: [agent_client.AgentState(state="loading", weight_version=None)]},
    )


def test_a_new_shard_copies_the_version_from_a_peer_is_retried_after_a_failure_then_caught_up() -> None:
    agents, events = StandInAgents(), list[tuple[str, str]]()
    ctx = fleet_context(agents, events, checkpoint=None)  # the last refit came from a trainer's rendezvous
    now = [0.0]

    def reconcile_at(seconds: float) -> None:
        now[0] = seconds
        asyncio.run(catch_up.start(ctx, clock=lambda: now[0]))

    reconcile_at(0)
    (kind, receiver, receive), (_, sender, send) = agents.calls
    assert (kind, receiver, sender) == ("receive", "10.0.0.3", "10.0.0.1")  # the receivers listen first
    assert isinstance(receive, agent_api.PeerRefitRequest) and isinstance(send, agent_api.PeerSendRequest)
    assert (receive.version, receive.integrity, receive.peer.address, receive.peer.port) == (
        5,
        "checksum",
        "10.0.0.1",
        ports.PEER_PORT,
    )
    assert (receive.peer.receivers, receive.peer.index, receive.peer.shard) == (1, 1, 0)
    assert (send.version, send.receivers, send.port, send.integrity) == (5, 1, ports.PEER_PORT, "checksum")
    assert events[-1] == ("ShardCatchingUp", "shard 2 copies version 5 from peer shard 0")
    reconcile_at(5)  # the copy failed; no checkpoint to fall back to: the next copy in 10 s
    assert len(agents.calls) == 2 and events[-1][0] == "CatchUpFailed"
    assert "from a peer (1 in a row: peer gone); next peer copy in 10 s" in events[-1][1]
    reconcile_at(9)
    assert len(agents.calls) == 2 and len(events) == 2
    agents.failing = False
    reconcile_at(15)
    assert len(agents.calls) == 4 and agents.phase == "running"
    ctx.reports[2] = [agent_client.AgentState(state="ready", weight_version=5)]
    reconcile_at(20)
    assert events[-1] == (
        "CaughtUp",
        "shard 2 serves version 5, caught up from peer shard 0, every bucket verified (mf64)",
    )
    reconcile_at(25)
    assert events[-1][0] == "CaughtUp" and len(events) == 4 and len(agents.calls) == 4  # said once


def test_a_failed_peer_copy_falls_back_to_the_checkpoint_at_once() -> None:
    agents, events = StandInAgents(), list[tuple[str, str]]()
    ctx = fleet_context(agents, events, checkpoint="/ckpt/v5")
    asyncio.run(catch_up.start(ctx, clock=lambda: 0.0))
    assert [kind for kind, _, _ in agents.calls] == ["receive", "send"]
    asyncio.run(catch_up.start(ctx, clock=lambda: 1.0))
    kind, ip, body = agents.calls[-1]
    assert kind == "receive" and ip == "10.0.0.3" and isinstance(body, agent_api.CheckpointRefitRequest)
    assert events[-2][0] == "CatchUpFailed"
    assert events[-1] == ("ShardCatchingUp", "shard 2 loads version 5 from /ckpt/v5 (the copy from a peer failed)")


def test_a_megatron_fleet_catches_up_from_the_checkpoint_and_says_why() -> None:
    agents, events = StandInAgents(), list[tuple[str, str]]()
    ctx = fleet_context(agents, events, checkpoint="/ckpt/v5", backend="megatron")
    asyncio.run(catch_up.start(ctx, clock=lambda: 0.0))
    assert [type(body) for _, _, body in agents.calls] == [agent_api.CheckpointRefitRequest]
    assert events[-1][1].endswith("(the megatron backend's sharded weights are not copied from peers)")


def test_a_fleet_that_catches_up_from_the_checkpoint_only_copies_nothing_from_peers() -> None:
    agents, events = StandInAgents(), list[tuple[str, str]]()
    ctx = fleet_context(agents, events, checkpoint="/ckpt/v5", catch_up_from="checkpoint")
    asyncio.run(catch_up.start(ctx, clock=lambda: 0.0))
    assert [type(body) for _, _, body in agents.calls] == [agent_api.CheckpointRefitRequest]
    assert events[-1] == ("ShardCatchingUp", "shard 2 loads version 5 from /ckpt/v5")
    agents.calls.clear()
    ctx = fleet_context(agents, events, checkpoint=None, catch_up_from="checkpoint")
    asyncio.run(catch_up.start(ctx, clock=lambda: 0.0))
    assert agents.calls == []  # Stale until the next refit


def test_a_busy_peer_is_waited_for_and_a_silent_one_falls_back_to_the_checkpoint() -> None:
    agents, events = StandInAgents(), list[tuple[str, str]]()
    agents.peer_phase = "sending"  # still sending an earlier copy: nothing now, the next reconcile tries again
    ctx = fleet_context(agents, events, checkpoint="/ckpt/v5")
    asyncio.run(catch_up.start(ctx, clock=lambda: 0.0))
    assert agents.calls == [] and events == []
    agents.peer_phase, agents.peer_silent = "idle", True
    asyncio.run(catch_up.start(ctx, clock=lambda: 1.0))
    assert [type(body) for _, _, body in agents.calls] == [agent_api.CheckpointRefitRequest]
    assert events[-1] == ("ShardCatchingUp", "shard 2 loads version 5 from /ckpt/v5 (peer shard 0 cannot send)")


def test_the_catch_up_source_rolls_no_pod() -> None:
    """``spec.weights.catchUp`` is read by the operator between refits; no pod carries it."""
    hashes = {
        desired.template_hash(
            desired.ParsedFleet(
                "gen",
                "rl",
                "u",
                1,
                v1alpha1.MegatronGenerationSpec.model_validate(
                    {"model": {"source": "/models/m"}, "weights": {"catchUp": source}}
                ),
            )
        )
        for source in ("peer", "checkpoint")
    }
    assert len(hashes) == 1
