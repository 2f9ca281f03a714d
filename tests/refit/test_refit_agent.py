"""The agent's refit API on an engine in this process (so the live tensors can be inspected), with the
trainer's SDK on a thread over gloo: weights written in place and served only as a whole version,
manifest refusal before any byte moves, idempotent prepare, 409 while busy, explicit abort, and the
resume guard after a refit that failed half-way."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from helpers import refit_harness as harness
from megafleet_protocol.refit import communicator, errors, wire
from megafleet_protocol.refit import sender as sdk

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

PROMPT = [40, 41, 42, 43, 44]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.InProcessEngine]:
    with harness.serve_in_process(harness.token_file(tmp_path)) as running:
        yield running


@pytest.fixture(scope="module")
def trainer() -> harness.Trainer:
    return harness.Trainer()


def test_refit_writes_in_place_and_serves_the_new_version_only_when_complete(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    live = served.backend.parameters()
    pointers = {name: tensor.data_ptr() for name, tensor in live.items()}
    before, header = harness.completion_ids(served.frontend_url, PROMPT, 8)
    expected = trainer.greedy(PROMPT, 8)
    assert header == "0" and before != expected, "the trainer's weights must change the output"

    port = harness.free_port()
    sending = trainer.send_in_background(port, 2, version=5)
    accepted = served.agent.prepare(5, port=port, world_size=2, rank_offset=1)
    assert accepted.status_code == 202, accepted.text
    assert accepted.json()["phase"] in ("suspending", "joining", "receiving")
    status = served.agent.wait_finished()
    report = sending.result()

    assert status["phase"] == "succeeded", status
    assert (status["version"], status["rank"], status["worldSize"], status["error"]) == (5, 1, 2, None)
    assert [phase["name"] for phase in status["phases"]] == ["suspend", "join", "receive", "apply", "resume"]
    assert report is not None and status["bytesReceived"] == report.bytes_sent > 0
    assert status["tensorsWritten"] == len(live) == report.tensors
    assert (status["state"], status["weightVersion"], status["dirty"]) == ("ready", 5, False)
    weights = trainer.weights()
    for name, tensor in served.backend.parameters().items():
        assert tensor.data_ptr() == pointers[name], f"{name} was rebound"
        assert torch.equal(tensor, weights[name]), name
    assert harness.completion_ids(served.frontend_url, PROMPT, 8) == (expected, "5")


def test_a_manifest_that_does_not_fit_is_refused_before_any_weight_moves(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    original = {name: tensor.clone() for name, tensor in served.backend.parameters().items()}
    weights = trainer.weights()
    del weights["model.norm.weight"]
    weights["lm_head.weight"] = weights["lm_head.weight"][:-1]
    port = harness.free_port()
    sending = trainer.send_in_background(port, 2, version=3, weights=weights)
    assert served.agent.prepare(3, port=port, world_size=2, rank_offset=1).status_code == 202
    status = served.agent.wait_finished()
    with pytest.raises(errors.RefitRejected) as rejected:
        sending.result()

    assert status["phase"] == "failed" and not status["dirty"] and status["bytesReceived"] == 0
    assert "lacks 1 parameters" in status["error"] and "lm_head.weight" in status["error"]
    assert rejected.value.reasons == {1: status["error"]}
    assert (status["state"], status["weightVersion"]) == ("stale", 0)
    for name, tensor in served.backend.parameters().items():
        assert torch.equal(tensor, original[name]), f"{name} changed although nothing was sent"
    with served.agent.client() as agent:  # nothing was written: serving the old version is allowed
        assert agent.post("/v1/resume", json={}).json()["state"] == "ready"


def test_prepare_is_idempotent_a_second_refit_is_refused_and_abort_ends_it_at_once(
    served: harness.InProcessEngine,
) -> None:
    port = harness.free_port()
    first = served.agent.prepare(7, port=port, world_size=2, rank_offset=1, timeout_seconds=5)
    again = served.agent.prepare(7, port=port, world_size=2, rank_offset=1, timeout_seconds=5)
    other = served.agent.prepare(8, port=harness.free_port(), world_size=2, rank_offset=1)
    assert (first.status_code, again.status_code) == (202, 202)
    assert again.json()["version"] == 7
    assert other.status_code == 409 and other.json()["error"]["code"] == "refit_in_progress"
    with served.agent.client() as agent:
        resume = agent.post("/v1/resume", json={})
        assert resume.status_code == 409 and resume.json()["error"]["code"] == "refit_in_progress"
        started = time.monotonic()
        aborted = agent.post("/v1/refit/abort", json={"reason": "shard 3 died"}).json()
        assert time.monotonic() - started < 2, "abort answers at once, even while the attempt waits"
    assert aborted["phase"] == "failed" and aborted["error"] == "aborted: shard 3 died"
    assert not aborted["timedOut"] and aborted["state"] == "stale"
    assert served.refits.wait_settled(2.0), "the abort also ends the attempt's wait for the trainer"
    with httpx.Client(timeout=30) as client:
        refused = client.post(f"{served.frontend_url}/v1/completions", json={"model": harness.MODEL, "prompt": "x"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "stale"


def test_a_refit_that_fails_half_way_keeps_the_engine_stale_until_a_complete_one(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    """A trainer that sends the first of two buckets and stops: the engine holds parts of two versions,
    so it stays stale, resume is refused, and the next complete refit brings it back."""
    weights = trainer.weights()
    port = harness.free_port()
    assert served.agent.prepare(4, port=port, world_size=2, rank_offset=1, timeout_seconds=3).status_code == 202
    deadline = communicator.Deadline(30)
    rendezvous = communicator.Rendezvous(harness.TRAINER_ADDRESS, port, 2)
    comm = communicator.Communicator.connect(
        rendezvous,
        global_rank=0,
        backend="gloo",
        device=torch.device("cpu"),
        deadline=deadline,
        local_address=harness.TRAINER_ADDRESS,
    )
    try:
        comm.open_round(4)  # the receiver's hello, the group decision, the group and its handshake
        infos = tuple(wire.TensorInfo.of(name, tensor) for name, tensor in weights.items())
        plan = wire.plan_buckets(
            ((wire.Region.whole(i.name), wire.Region.whole(i.name).nbytes(i)) for i in infos), 2**18
        )
        assert len(plan.sizes) >= 2
        comm.set(wire.MANIFEST_KEY, wire.Manifest(4, "broadcast", 2**18, infos, plan).encode())
        comm.get(wire.verdict_key(1), what="the verdict")
        comm.set(wire.GO_KEY, wire.Go(True).encode())
        first = torch.zeros(plan.sizes[0], dtype=torch.uint8)
        for placement in plan.in_bucket(0):
            wire.pack(first, placement, weights[placement.region.name])
        comm.broadcast(first, what="the first bucket")
        status = served.agent.wait_finished(timeout=30)
    finally:
        comm.close()

    assert status["phase"] == "failed" and status["timedOut"] and status["dirty"], status
    assert status["buckets"] == 1 and status["state"] == "stale"
    with served.agent.client() as agent:
        resume = agent.post("/v1/resume", json={})
    assert resume.status_code == 409 and resume.json()["error"]["code"] == "weights_incomplete"

    port = harness.free_port()
    sending = trainer.send_in_background(port, 2, version=6)
    assert served.agent.prepare(6, port=port, world_size=2, rank_offset=1).status_code == 202
    assert served.agent.wait_finished()["phase"] == "succeeded"
    assert isinstance(sending.result(), sdk.SendReport)
    assert served.agent.state()["state"] == "ready"
    assert harness.completion_ids(served.frontend_url, PROMPT, 6) == (trainer.greedy(PROMPT, 6), "6")


@pytest.mark.parametrize(
    ("rendezvous", "message"),
    [
        ({"worldSize": 2, "rankOffset": 2}, "is not trainer rank 0 nor a fleet rank"),
        ({"worldSize": 3, "rankOffset": 1, "trainerWorldSize": 2}, "is not trainer rank 0 nor a fleet rank"),
        ({"worldSize": 1, "rankOffset": 1}, "greater than or equal to 2"),
    ],
    ids=["offset-past-world", "offset-inside-trainer", "no-fleet"],
)
def test_prepare_rejects_ranks_that_do_not_fit(
    served: harness.InProcessEngine, rendezvous: dict[str, int], message: str
) -> None:
    body = {"version": 1, "rendezvous": {"address": harness.TRAINER_ADDRESS, "port": 1234, **rendezvous}}
    with served.agent.client() as agent:
        response = agent.post("/v1/refit/prepare", json=body)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert served.agent.status()["phase"] == "idle"


def test_refit_routes_need_the_token_and_unknown_operations_are_404(served: harness.InProcessEngine) -> None:
    with httpx.Client(base_url=served.agent.url, timeout=30) as anonymous:
        assert anonymous.get("/v1/refit/status").status_code == 401
        assert anonymous.post("/v1/refit/prepare", json={}).status_code == 401
    with served.agent.client() as agent:
        unknown = agent.post("/v1/refit/begin", json={})
        idle = agent.get("/v1/refit/status").json()
    assert unknown.status_code == 404 and "prepare" in unknown.json()["error"]["message"]
    assert (idle["phase"], idle["version"], idle["phases"], idle["state"]) == ("idle", None, [], "ready")
