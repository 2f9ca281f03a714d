"""Catch-up from a peer between two real engine processes (``python -m megafleet_engine.cli``, each on
its own 127.x address), driven through their agents as the operator drives them, over gloo.

Engine A serves a version that came from a trainer (no checkpoint holds it); engine B starts without
weights (``MEGAFLEET_WEIGHTS_INITIAL=refit``), as a shard added by a scale-out after that refit. A is
asked to send (``POST /v1/peer/send``) and B to receive (``POST /v1/refit/peer``): B then serves A's
version, its greedy tokens equal to A's (and to the trainer model's), every bucket verified with its
``mf64`` digest; A answers requests all through the copy. A copy of a version A does not serve, or
from a shard whose version moved, is refused before anything moves.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers import refit_harness as harness

pytestmark = pytest.mark.slow  # each test starts engines

PROMPT = [50, 51, 52, 53]
SOURCE_HOST, RECEIVER_HOST = "127.0.33.1", "127.0.33.2"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[harness.EngineProcess, harness.EngineProcess]]:
    token = harness.token_file(tmp_path_factory.mktemp("agent"))
    source = harness.EngineProcess(SOURCE_HOST, token)
    receiver = harness.EngineProcess(RECEIVER_HOST, token, deferred=True)
    try:
        source.wait_serving()
        receiver.wait_serving()
        yield source, receiver
    finally:
        source.close()
        receiver.close()


def post(agent: harness.AgentClient, path: str, body: dict[str, Any]) -> httpx.Response:
    with agent.client() as client:
        return client.post(path, json=body)


def send_body(version: int, port: int) -> dict[str, Any]:
    return {"version": version, "port": port, "receivers": 1, "timeoutSeconds": 60, "bucketSizeMiB": 1}


def receive_body(version: int, port: int) -> dict[str, Any]:
    return {
        "version": version,
        "timeoutSeconds": 60,
        "integrity": "checksum",
        "bucketSizeMiB": 1,
        "peer": {"address": SOURCE_HOST, "port": port, "receivers": 1, "index": 1, "shard": 0},
    }


def test_a_shard_without_weights_catches_up_from_a_serving_peer_which_serves_on(
    engines: tuple[harness.EngineProcess, harness.EngineProcess],
) -> None:
    source, receiver = engines
    trainer = harness.Trainer("tiny://llama?seed=21")
    port = harness.free_port()
    sending = trainer.send_in_background(port, 2, version=4)
    assert source.agent.prepare(4, port=port, world_size=2, rank_offset=1).status_code == 202
    assert source.agent.wait_finished()["phase"] == "succeeded"
    sending.result()
    expected = trainer.greedy(PROMPT, 8)
    assert harness.completion_ids(source.frontend_url, PROMPT, 8) == (expected, "4")

    refused = post(source.agent, "/v1/peer/send", send_body(3, harness.free_port(SOURCE_HOST)))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "peer_not_current"

    served: list[tuple[list[int], str]] = []
    copying = threading.Event()

    def keep_asking() -> None:  # the source answers all through the copy
        while not copying.is_set():
            served.append(harness.completion_ids(source.frontend_url, PROMPT, 8))

    asking = threading.Thread(target=keep_asking, daemon=True)
    asking.start()
    peer_port = harness.free_port(SOURCE_HOST)
    accepted = post(source.agent, "/v1/peer/send", send_body(4, peer_port))
    assert accepted.status_code == 202, accepted.text
    assert accepted.json()["phase"] in ("sending", "sent")
    started = post(receiver.agent, "/v1/refit/peer", receive_body(4, peer_port))
    assert started.status_code == 202, started.text
    status = receiver.agent.wait_finished()
    copying.set()
    asking.join(60)

    assert status["phase"] == "succeeded", status
    assert (status["source"], status["version"], status["rank"], status["worldSize"]) == ("peer", 4, 1, 2)
    verification = status["verification"]
    assert verification["integrity"] == "checksum" and verification["buckets"] == status["buckets"] >= 1
    assert verification["mismatch"] is None
    assert harness.completion_ids(receiver.frontend_url, PROMPT, 8) == (expected, "4")
    assert served and all(answer == (expected, "4") for answer in served)
    with source.agent.client() as client:
        sent = client.get("/v1/peer/status").json()
    assert sent["phase"] == "sent" and sent["verified"] and sent["bytesSent"] > 0, sent
    assert source.agent.state()["weightVersion"] == 4 and source.agent.status()["version"] == 4  # untouched

    again = post(receiver.agent, "/v1/peer/send", send_body(3, harness.free_port(RECEIVER_HOST)))
    assert again.status_code == 409 and again.json()["error"]["code"] == "peer_not_current"
