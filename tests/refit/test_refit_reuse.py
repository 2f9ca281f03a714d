"""Refit after refit over one trainer session: the transfer group is kept (NeMo RL's
``init_collective`` once, ``update_weights_from_collective`` per step) and dropped whenever anything
changes, over gloo with real engine processes (``python -m megafleet_engine.cli``) and, where the
live controller must be inspected, an engine in this process.

Each refit is checked end to end: the agent's status (``reused``: no group was built), the trainer's
report, and greedy completions through the OpenAI frontend equal to the trainer model's own, stamped
with the new version.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers import refit_harness as harness
from megafleet.sdk import fleet as sdk_fleet
from megafleet.sdk import weights as sdk_weights
from megafleet_protocol.refit import errors
from megafleet_protocol.refit import sender as sdk

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

PROMPT = [60, 61, 62, 63]
TOKENS = 6


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[harness.EngineProcess]]:
    token = harness.token_file(tmp_path_factory.mktemp("agent"))
    running = [harness.EngineProcess("127.0.13.1", token), harness.EngineProcess("127.0.13.2", token)]
    try:
        for engine in running:
            engine.wait_serving()
        yield running
    finally:
        for engine in running:
            engine.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.InProcessEngine]:
    with harness.serve_in_process(harness.token_file(tmp_path)) as running:
        yield running


def refit(
    engines: list[harness.EngineProcess], sender: sdk.WeightSender, trainer: harness.Trainer, version: int
) -> tuple[sdk.SendReport, list[dict[str, object]]]:
    """Prepare every engine (rank offsets 1, 2, ...) on the sender's rendezvous, then send: one Refit's
    attempt as the operator and the trainer run it."""
    port, world_size = sender.rendezvous.port, sender.rendezvous.world_size
    for offset, engine in enumerate(engines, start=1):
        accepted = engine.agent.prepare(version, port=port, world_size=world_size, rank_offset=offset)
        assert accepted.status_code == 202, accepted.text
    report = sender.send(trainer.weights().items(), bucket_size_mib=1, version=version)
    return report, [engine.agent.wait_finished() for engine in engines]


def serves(engines: list[harness.EngineProcess], trainer: harness.Trainer, version: int) -> bool:
    expected = (trainer.greedy(PROMPT, TOKENS), str(version))
    return all(harness.completion_ids(engine.frontend_url, PROMPT, TOKENS) == expected for engine in engines)


def test_refits_over_one_sender_keep_the_group_and_a_new_session_on_the_same_port_builds_one(
    engines: list[harness.EngineProcess],
) -> None:
    trainers = [harness.Trainer(f"tiny://llama?seed={seed}") for seed in (21, 22, 23, 24)]
    assert len({tuple(t.greedy(PROMPT, TOKENS)) for t in trainers}) == 4
    port = harness.free_port()
    sender = sdk.WeightSender(port, 3, address=harness.TRAINER_ADDRESS, timeout_seconds=60)
    sender.init()
    try:
        report, statuses = refit(engines, sender, trainers[0], 1)
        assert not report.reused and report.manifest_sent and [s["reused"] for s in statuses] == [False, False]
        assert all(s["phase"] == "succeeded" for s in statuses), statuses
        assert serves(engines, trainers[0], 1)

        for version, trainer in ((2, trainers[1]), (3, trainers[2])):
            report, statuses = refit(engines, sender, trainer, version)
            assert report.reused and not report.manifest_sent and report.receivers == 2, report
            assert [(s["phase"], s["reused"], s["rank"]) for s in statuses] == [
                ("succeeded", True, 1),
                ("succeeded", True, 2),
            ], statuses
            assert all(s["bytesReceived"] == report.bytes_sent for s in statuses)
            assert serves(engines, trainer, version)

        with pytest.raises(ValueError, match="already sent"):
            sender.send(trainers[0].weights().items(), version=3)
        assert sender.usable
    finally:
        sender.close()

    # Same address, port and world size, but another session (the trainer reopened its sender).
    reopened = sdk.WeightSender(port, 3, address=harness.TRAINER_ADDRESS, timeout_seconds=60)
    reopened.init()
    try:
        report, statuses = refit(engines, reopened, trainers[3], 4)
        assert not report.reused and report.manifest_sent  # a new session: nothing is taken over
        assert [(s["phase"], s["reused"]) for s in statuses] == [("succeeded", False)] * 2
        assert serves(engines, trainers[3], 4)
    finally:
        reopened.close()


def test_a_failed_refit_an_abort_and_a_timeout_never_leave_a_parked_group(served: harness.InProcessEngine) -> None:
    trainer = harness.Trainer("tiny://llama?seed=31")
    agent = served.agent
    port, sender = harness.open_sender()

    def attempt(version: int, weights: dict[str, torch.Tensor] | None = None) -> None:
        assert agent.prepare(version, port=port, world_size=2, rank_offset=1).status_code == 202
        sender.send((weights or trainer.weights()).items(), bucket_size_mib=1, version=version)

    try:
        attempt(1)
        assert agent.wait_finished()["phase"] == "succeeded" and served.refits.parked

        # A receiver that fails (it rejects a manifest lacking a tensor) drops its group; the sender is done for.
        partial = dict(list(trainer.weights().items())[1:])
        with pytest.raises(errors.RefitRejected):
            attempt(2, partial)
        status = agent.wait_finished()
        assert status["phase"] == "failed" and "lacks" in status["error"], status
        assert not served.refits.parked and not sender.usable
        with pytest.raises(RuntimeError, match="unusable"):
            sender.send(trainer.weights().items(), version=3)
    finally:
        sender.close()

    # A new session: refit, then an explicit abort closes the parked group.
    sender = sdk.WeightSender(port, 2, address=harness.TRAINER_ADDRESS, timeout_seconds=30)
    sender.init()
    try:
        attempt(3)
        assert agent.wait_finished()["reused"] is False and served.refits.parked
        with agent.client() as client:
            assert client.post("/v1/refit/abort", json={"reason": "test"}).status_code == 200
        assert not served.refits.parked

        # The engine closed its group: the trainer's next send builds a new one.
        attempt(4)
        status = agent.wait_finished()
        assert (status["phase"], status["reused"]) == ("succeeded", False) and served.refits.parked
        attempt(5)
        assert agent.wait_finished()["reused"] is True

        # The trainer never sends version 6: the watchdog ends the attempt, and nothing stays parked.
        assert agent.prepare(6, port=port, world_size=2, rank_offset=1, timeout_seconds=2).status_code == 202
        timed_out = agent.wait_finished()
        assert timed_out["phase"] == "failed" and timed_out["timedOut"] and timed_out["reused"] is False
        assert served.refits.wait_settled(10) and not served.refits.parked

        attempt(7)
        status = agent.wait_finished()
        assert (status["phase"], status["reused"]) == ("succeeded", False), status
        assert harness.completion_ids(served.frontend_url, PROMPT, TOKENS) == (trainer.greedy(PROMPT, TOKENS), "7")
    finally:
        sender.close()


def test_the_sdk_sender_keeps_its_weight_sender_only_for_the_same_rendezvous(
    engines: list[harness.EngineProcess],
) -> None:
    """:class:`megafleet.sdk.weights.Sender` with ``keep_open``, driven with the attempts
    :meth:`Fleet.refit` would hand it: reuse across Refits on the same port and world size, a new
    sender (and group) on another port, and the kept one closed then."""
    trainer = harness.Trainer("tiny://llama?seed=41")
    reports: list[sdk.SendReport] = []
    send = sdk_weights.sender(trainer.weights().items, reports=reports, timeout_seconds=60, keep_open=True)
    base = harness.free_port()
    try:
        for version, port in ((11, base), (12, base), (13, base + 1), (14, base + 1)):
            attempt = sdk_fleet.Attempt(
                refit=f"tiny-v{version}",
                version=version,
                attempt=1 if port == base else 2,
                address=harness.TRAINER_ADDRESS,
                port=port,
                world_size=3,
                trainer_world_size=1,
                transport="broadcast",
                bucket_size_mib=1,
            )
            for offset, engine in enumerate(engines, start=1):
                assert engine.agent.prepare(version, port=port, world_size=3, rank_offset=offset).status_code == 202
            sending = threading.Thread(target=send, args=(attempt,))
            sending.start()
            statuses = [engine.agent.wait_finished() for engine in engines]
            sending.join(60)
            attempt.superseded.set()  # what Fleet.refit does once the Refit ended: a finished send is kept
            assert all(s["phase"] == "succeeded" for s in statuses), statuses
            assert serves(engines, trainer, version)
        assert [report.reused for report in reports] == [False, True, False, True]
        # the first store was closed when the sender moved on: nothing listens there any more (a bind
        # probe would fail on the closed connections' TIME_WAIT, which is not a listener)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((harness.TRAINER_ADDRESS, base), timeout=5).close()
    finally:
        send.close()
