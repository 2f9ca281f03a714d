"""A pod of several rank processes (``MEGAFLEET_LOCAL_RANKS=2`` on CPU: two spawned ranks of one
shard, as one per GPU on a GPU node) refitted through its one agent: local rank 0's agent forwards
the refit to local rank 1's agent, both ranks join the trainer's world at their own ranks, and the
pod answers one status: succeeded only when both did, failed when either failed."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers import engine_command
from helpers import refit_harness as harness

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

POD_IP = "127.0.12.1"
PROMPT = [60, 61, 62]


def _free_pair(host: str) -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free on ``host`` (the two ranks' agents)."""
    for _ in range(50):
        port = harness.free_port(host)
        with socket.socket() as probe:
            try:
                probe.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two adjacent free ports")


class Pod(engine_command.EngineCommand):
    """``python -m megafleet_engine.cli`` with two local ranks on CPU (a TP=2 shard in one pod)."""

    def __init__(self, token: Path) -> None:
        self.agent_port = _free_pair(POD_IP)
        super().__init__(
            {
                "MEGAFLEET_MODEL_SOURCE": harness.SOURCE,
                "MEGAFLEET_SERVED_MODEL_NAME": harness.MODEL,
                "MEGAFLEET_DTYPE": "float32",
                "MEGAFLEET_MAX_SEQUENCE_LENGTH": "128",
                "MEGAFLEET_HOST": POD_IP,
                "MEGAFLEET_FRONTEND_PORT": "0",
                "MEGAFLEET_AGENT_PORT": str(self.agent_port),
                "MEGAFLEET_METRICS_PORT": "0",
                "MEGAFLEET_AGENT_TOKEN_FILE": str(token),
                "MEGAFLEET_WORLD_SIZE": "2",
                "MEGAFLEET_TENSOR_PARALLEL": "2",
                "MEGAFLEET_LOCAL_RANKS": "2",
                "MEGAFLEET_MASTER_ADDR": POD_IP,
                "MEGAFLEET_MASTER_PORT": str(harness.free_port(POD_IP)),
            }
        )

    @property
    def frontend_url(self) -> str:
        return "http://" + self.wait_serving("frontend")["frontend"]

    def agent(self, local_rank: int = 0) -> harness.AgentClient:
        return harness.AgentClient(f"http://{POD_IP}:{self.agent_port + local_rank}")


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    started = Pod(harness.token_file(tmp_path_factory.mktemp("agent")))
    try:
        started.wait_serving("frontend", "agent", "agent", "metrics")  # both ranks' agents
        yield started
    finally:
        code = started.stop(timeout=60)
    assert code == 0, "".join(started.log[-20:])


def test_the_pod_agent_refits_every_local_rank_and_reports_one_status(pod: Pod) -> None:
    trainer = harness.Trainer()
    port = harness.free_port()
    sending = trainer.send_in_background(port, 3, version=1)  # trainer rank 0, then the pod's ranks 1 and 2
    accepted = pod.agent().prepare(1, port=port, world_size=3, rank_offset=1)
    assert accepted.status_code == 202, accepted.text
    status = pod.agent().wait_finished()
    report = sending.result()

    assert report is not None and report.receivers == 2, "both local ranks joined the trainer's world"
    assert status["phase"] == "succeeded", status
    one_rank = pod.agent(1).status()
    assert (one_rank["phase"], one_rank["rank"], one_rank["version"]) == ("succeeded", 2, 1)
    assert status["bytesReceived"] == 2 * one_rank["bytesReceived"] > 0, "the pod's counters sum its ranks"
    assert harness.completion_ids(pod.frontend_url, PROMPT, 6) == (trainer.greedy(PROMPT, 6), "1")


def test_a_failed_local_rank_fails_the_pod_and_a_complete_refit_recovers_it(pod: Pod) -> None:
    trainer = harness.Trainer("tiny://llama?seed=13")
    nobody = harness.free_port()  # no trainer listens: both ranks keep trying to join until told
    assert pod.agent().prepare(2, port=nobody, world_size=3, rank_offset=1).status_code == 202
    with pod.agent(1).client() as rank1:  # local rank 1 fails on its own
        assert rank1.post("/v1/refit/abort", json={"reason": "injected"}).status_code == 200
    status = pod.agent().status()
    assert status["phase"] == "failed" and status["error"] == "rank 2: aborted: injected", status
    assert pod.agent().state()["state"] == "suspended", "rank 0 still waits to join, its gate closed"
    with pod.agent().client() as agent:  # the operator aborts the pod's attempt, as after any failure
        assert agent.post("/v1/refit/abort", json={"reason": "a rank failed"}).json()["phase"] == "failed"
    with httpx.Client(timeout=30) as client:
        stale = client.post(f"{pod.frontend_url}/v1/completions", json={"model": harness.MODEL, "prompt": "x"})
    assert stale.status_code == 503, "a pod that failed a refit serves nothing"

    port = harness.free_port()
    sending = trainer.send_in_background(port, 3, version=3)
    assert pod.agent().prepare(3, port=port, world_size=3, rank_offset=1).status_code == 202
    assert pod.agent().wait_finished()["phase"] == "succeeded"
    sending.result()
    assert harness.completion_ids(pod.frontend_url, PROMPT, 6) == (trainer.greedy(PROMPT, 6), "3")
