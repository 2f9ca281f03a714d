"""Refits of real engine processes (``python -m megafleet_engine.cli``, each on its own 127.x address)
driven through their agents' HTTP API as the operator drives them, with membership from the planner
and the trainer's SDK on a thread of this process, over gloo.

Engine A starts from the checkpoint (weight version 0); engine B defers its weights until its first
refit (``MEGAFLEET_WEIGHTS_INITIAL=refit``). Afterwards every engine's greedy completions (official
``openai`` client) equal the trainer model's own, stamped with the new version.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import save_file

from helpers import refit_harness as harness
from megafleet.planner import layout

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

PROMPT = [50, 51, 52, 53]
SHARD_SIZE = 1  # a CPU shard is one rank
WATCHDOG_SLACK_SECONDS = 1.5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[harness.EngineProcess]]:
    token = harness.token_file(tmp_path_factory.mktemp("agent"))
    engines = [
        harness.EngineProcess("127.0.11.1", token),
        harness.EngineProcess("127.0.11.2", token, deferred=True),
    ]
    try:
        for engine in engines:
            engine.wait_serving()
        yield engines
    finally:
        for engine in engines:
            engine.close()


def refit(
    engines: dict[int, harness.EngineProcess], trainer: harness.Trainer, version: int
) -> dict[int, dict[str, object]]:
    """One refit of the shards ``engines`` (shard index -> its one pod), as the operator runs it:
    membership from the planner, a fresh port, prepare on every agent, then poll every status."""
    membership = layout.rank_offsets(1, list(engines), SHARD_SIZE)
    port = harness.free_port()
    sending = trainer.send_in_background(port, membership.world_size, version=version)
    for shard, engine in engines.items():
        accepted = engine.agent.prepare(
            version, port=port, world_size=membership.world_size, rank_offset=membership.offsets[shard]
        )
        assert accepted.status_code == 202, accepted.text
    statuses = {shard: engine.agent.wait_finished() for shard, engine in engines.items()}
    report = sending.result()
    assert report is not None and report.receivers == len(engines)
    return statuses


def test_refit_one_then_two_engines_and_the_deferred_one_becomes_ready_only_then(
    fleet: list[harness.EngineProcess],
) -> None:
    a, b = fleet
    with httpx.Client(timeout=30) as client:
        waiting = client.post(f"{b.frontend_url}/v1/completions", json={"model": harness.MODEL, "prompt": "x"})
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "loading"

    first = harness.Trainer()
    statuses = refit({0: a}, first, version=1)
    assert statuses[0]["phase"] == "succeeded" and statuses[0]["rank"] == 1 and statuses[0]["worldSize"] == 2
    assert harness.completion_ids(a.frontend_url, PROMPT, 8) == (first.greedy(PROMPT, 8), "1")
    assert (b.agent.state()["state"], b.agent.state()["weightVersion"]) == ("loading", None)
    assert b.agent.status()["phase"] == "idle"

    second = harness.Trainer("tiny://llama?seed=11")
    statuses = refit({0: a, 1: b}, second, version=2)
    assert [(s["phase"], s["rank"], s["worldSize"]) for s in statuses.values()] == [
        ("succeeded", 1, 3),
        ("succeeded", 2, 3),
    ]
    expected = second.greedy(PROMPT, 8)
    assert expected != first.greedy(PROMPT, 8)
    for engine in (a, b):
        assert harness.completion_ids(engine.frontend_url, PROMPT, 8) == (expected, "2")
        assert engine.agent.state()["state"] == "ready"
    with b.agent.client() as agent:
        assert agent.get("/readyz").status_code == 200


def test_watchdog_aborts_a_refit_whose_trainer_never_sends_and_a_later_refit_recovers(
    fleet: list[harness.EngineProcess],
) -> None:
    a = fleet[0]
    trainer = harness.Trainer("tiny://llama?seed=12")
    timeout = 3
    port = harness.free_port()
    silent = trainer.send_in_background(port, 2, version=10, send=False)  # joins, then never sends
    started = time.monotonic()
    assert a.agent.prepare(10, port=port, world_size=2, rank_offset=1, timeout_seconds=timeout).status_code == 202
    answered = time.monotonic()
    assert a.agent.state()["state"] in ("suspended", "ready")  # the agent answers while the refit waits
    assert time.monotonic() - answered < 1.0
    status = a.agent.wait_finished(timeout=timeout + 10)
    elapsed = time.monotonic() - started
    assert silent.result() is None

    assert status["phase"] == "failed" and status["timedOut"], status
    assert "timeoutSeconds=3" in status["error"] or "deadline" in status["error"]
    assert elapsed <= timeout + WATCHDOG_SLACK_SECONDS, f"aborted after {elapsed:.2f} s"
    assert timeout * 1000 - 100 <= status["durationMilliseconds"] <= (timeout + WATCHDOG_SLACK_SECONDS) * 1000
    assert (status["state"], status["dirty"]) == ("stale", False)
    with httpx.Client(timeout=30) as client:
        refused = client.post(f"{a.frontend_url}/v1/completions", json={"model": harness.MODEL, "prompt": "x"})
        health = client.get(f"{a.frontend_url}/health")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "stale"
    assert health.status_code == 503

    statuses = refit({0: a}, trainer, version=11)
    assert statuses[0]["phase"] == "succeeded"
    assert harness.completion_ids(a.frontend_url, PROMPT, 6) == (trainer.greedy(PROMPT, 6), "11")


def test_checkpoint_source_refit_loads_the_trainers_saved_weights(
    fleet: list[harness.EngineProcess], tmp_path: Path
) -> None:
    a = fleet[0]
    trainer = harness.Trainer("tiny://llama?seed=13")
    save_file({name: tensor.contiguous() for name, tensor in trainer.weights().items()}, tmp_path / "model.safetensors")
    with a.agent.client() as agent:
        accepted = agent.post("/v1/refit/checkpoint", json={"version": 20, "path": str(tmp_path)})
    assert accepted.status_code == 202, accepted.text
    status = a.agent.wait_finished()
    assert status["phase"] == "succeeded" and status["source"] == "checkpoint", status
    assert [phase["name"] for phase in status["phases"]] == ["suspend", "apply", "resume"]
    assert harness.completion_ids(a.frontend_url, PROMPT, 8) == (trainer.greedy(PROMPT, 8), "20")
