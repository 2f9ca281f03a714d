"""How a refit round opens and closes, on an engine in this process with the trainer's SDK over gloo:
a manifest every receiver already holds is confirmed in the group decision instead of being sent
again (and anything that changed goes through the full exchange and its checks); the engine
suspends while the round opens, and nothing is received or written before the suspend ended; the
trainer's ``send()`` returns only once the engine serves the new version."""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._C import _distributed_c10d as c10d

from helpers import refit_harness as harness
from megafleet_engine.refit_attempts import sinks
from megafleet_protocol.refit import communicator, errors, wire
from megafleet_protocol.refit import sender as sdk

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

PROMPT = [50, 51, 52, 53]
TOKENS = 5


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.InProcessEngine]:
    with harness.serve_in_process(harness.token_file(tmp_path)) as running:
        yield running


def round_keys(port: int, version: int, *names: str) -> list[bool]:
    """Which of the round's store keys exist now (a client of the trainer's store, as a receiver is)."""
    store = c10d.TCPStore(harness.TRAINER_ADDRESS, port, None, False, datetime.timedelta(seconds=10))
    return [store.check([f"{communicator.STORE_PREFIX}round/{version}/{name}"]) for name in names]


def serving(agent: harness.AgentClient) -> tuple[str, int | None, str]:
    """The engine's state, weight version and refit phase, read once (no waiting)."""
    with agent.client() as client:
        state = client.get("/v1/state").json()
        status = client.get("/v1/refit/status").json()
    return state["state"], state["weightVersion"], status["phase"]


def test_a_held_manifest_is_confirmed_not_resent_and_any_change_is_exchanged_and_checked(
    served: harness.InProcessEngine,
) -> None:
    trainers = [harness.Trainer(f"tiny://llama?seed={seed}") for seed in (61, 62)]
    agent = served.agent
    port, sender = harness.open_sender()

    def refit(version: int, *, engine_bucket_mib: int = 1, trainer_bucket_mib: int = 1) -> sdk.SendReport:
        prepared = agent.prepare(version, port=port, world_size=2, rank_offset=1, bucket_size_mib=engine_bucket_mib)
        assert prepared.status_code == 202, prepared.text
        weights = trainers[version % 2].weights()
        report = sender.send(weights.items(), bucket_size_mib=trainer_bucket_mib, version=version)
        # the receivers' acknowledgements come once the version serves: no polling needed here
        assert serving(agent) == ("ready", version, "succeeded")
        expected = (trainers[version % 2].greedy(PROMPT, TOKENS), str(version))
        assert harness.completion_ids(served.frontend_url, PROMPT, TOKENS) == expected
        return report

    try:
        first = refit(1)
        assert first.manifest_sent and not first.reused
        second = refit(2)
        assert not second.manifest_sent and second.reused
        # round 2 never held a manifest, verdict or go; round 1's were deleted during round 2's transfer
        assert round_keys(port, 2, "group", "hello/1", "done/1", "manifest", "verdict/1", "go") == [
            True,
            True,
            True,
            False,
            False,
            False,
        ]
        assert round_keys(port, 1, "group", "manifest", "go") == [False, False, False]

        # the engine's bucket limit changed: it does not offer the manifest it checked against the old one
        assert refit(3, engine_bucket_mib=2).manifest_sent
        # the trainer's buckets changed: a new manifest, checked by the engine
        assert refit(4, engine_bucket_mib=2, trainer_bucket_mib=2).manifest_sent
        assert not refit(5, engine_bucket_mib=2, trainer_bucket_mib=2).manifest_sent

        # an abort closes the parked group and forgets the manifest: the next round exchanges it again
        with agent.client() as client:
            assert client.post("/v1/refit/abort", json={"reason": "test"}).status_code == 200
        sixth = refit(6)
        assert sixth.manifest_sent and not sixth.reused

        # a manifest that no longer fits is exchanged and refused, even right after a held one
        assert not refit(7).manifest_sent
        partial = dict(list(trainers[0].weights().items())[1:])
        assert agent.prepare(8, port=port, world_size=2, rank_offset=1).status_code == 202
        with pytest.raises(errors.RefitRejected):
            sender.send(partial.items(), bucket_size_mib=1, version=8)
        status = agent.wait_finished()
        assert status["phase"] == "failed" and "lacks" in status["error"], status
    finally:
        sender.close()


def test_the_round_opens_while_the_engine_suspends_and_nothing_moves_before_the_suspend_ends(
    served: harness.InProcessEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The suspend is held open (a gate in front of the engine's own suspend): the trainer opens the
    round (its decision is in the store) while the engine still serves the old version, and no byte
    is received or written until the gate opens."""
    trainers = [harness.Trainer(f"tiny://llama?seed={seed}") for seed in (71, 72)]
    agent = served.agent
    port, sender = harness.open_sender()
    gate = threading.Event()
    try:
        assert agent.prepare(1, port=port, world_size=2, rank_offset=1).status_code == 202
        sender.send(trainers[0].weights().items(), bucket_size_mib=1, version=1)
        before = (trainers[0].greedy(PROMPT, TOKENS), "1")

        suspend = served.engine.suspend

        async def held_suspend(mode: Any, *, timeout_seconds: float, hold: bool = False) -> None:
            await asyncio.to_thread(gate.wait, 30)
            await suspend(mode, timeout_seconds=timeout_seconds, hold=hold)

        monkeypatch.setattr(served.engine, "suspend", held_suspend)
        assert agent.prepare(2, port=port, world_size=2, rank_offset=1).status_code == 202
        reports: list[sdk.SendReport] = []
        sending = threading.Thread(
            target=lambda: reports.append(sender.send(trainers[1].weights().items(), bucket_size_mib=1, version=2))
        )
        sending.start()
        store = c10d.TCPStore(harness.TRAINER_ADDRESS, port, None, False, datetime.timedelta(seconds=30))
        store.wait([f"{communicator.STORE_PREFIX}round/2/group"], datetime.timedelta(seconds=30))  # the decision

        with agent.client() as client:
            status = client.get("/v1/refit/status").json()
        assert status["phase"] == "joining" and status["bytesReceived"] == 0 and status["tensorsWritten"] == 0
        assert harness.completion_ids(served.frontend_url, PROMPT, TOKENS) == before  # still serving version 1

        gate.set()
        sending.join(30)
        assert not sending.is_alive() and reports and not reports[0].manifest_sent
        assert serving(agent) == ("ready", 2, "succeeded")
        assert harness.completion_ids(served.frontend_url, PROMPT, TOKENS) == (trainers[1].greedy(PROMPT, TOKENS), "2")
        assert all(
            torch.equal(served.backend.parameters()[name], tensor) for name, tensor in trainers[1].weights().items()
        )
    finally:
        gate.set()
        sender.close()


def test_a_write_that_rebinds_a_parameter_fails_the_refit_before_the_version_serves(
    served: harness.InProcessEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broken writer that replaces a parameter's storage (CUDA graphs would keep reading the old
    one) is caught by the in-place check: the refit fails, the engine stays stale, nothing serves."""
    trainer = harness.Trainer("tiny://llama?seed=81")
    agent = served.agent
    port, sender = harness.open_sender()
    try:
        assert agent.prepare(1, port=port, world_size=2, rank_offset=1).status_code == 202
        sender.send(trainer.weights().items(), bucket_size_mib=1, version=1)  # verified once, pointers kept

        name, parameter = next(iter(served.backend.model.named_parameters()))
        write = sinks.NamedSink.write

        def rebinding_write(self: sinks.NamedSink, region: wire.Region, tensor: torch.Tensor) -> int:
            if region.name == name:
                parameter.data = tensor.clone()  # a new storage, not a copy into the old one
                self._written.add(region.name)
                return 1
            return write(self, region, tensor)

        monkeypatch.setattr(sinks.NamedSink, "write", rebinding_write)
        assert agent.prepare(2, port=port, world_size=2, rank_offset=1).status_code == 202
        with pytest.raises(errors.ReceiverFailed, match="rebound"):
            sender.send(trainer.weights().items(), bucket_size_mib=1, version=2)
        status = agent.wait_finished()
        assert status["phase"] == "failed" and "rebound" in status["error"] and status["state"] == "stale", status
    finally:
        sender.close()
