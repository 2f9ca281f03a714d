"""The agent's ``POST /v1/refit/nemo`` on an engine in this process: an independent NeMo-style trainer
(:mod:`helpers.nemo_trainer`, rank 0 of a world with the engine as rank 1) hosts the store and
broadcasts NeMo's packed buckets over gloo; the engine joins once, refit after refit over the same
world, writes in place and serves each version whole. A refit info that does not fit is refused
before anything is suspended; an abort ends a refit that waits for the trainer."""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch._C import _distributed_c10d as c10d

from helpers import nemo_trainer
from helpers import refit_harness as harness
from megafleet_protocol.refit import digest
from megafleet_protocol.refit import nemo as nemo_protocol

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

PROMPT = [40, 41, 42, 43, 44]
WAIT_SECONDS = 60.0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.InProcessEngine]:
    with harness.serve_in_process(harness.token_file(tmp_path)) as running:
        yield running


@pytest.fixture(scope="module")
def trainer() -> harness.Trainer:
    return harness.Trainer()


def refit_info(weights: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    """NeMo's ``prepare_refit_info`` as JSON: name, shape and dtype, in the trainer's order."""
    return [{"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype)} for name, tensor in weights.items()]


def nemo_body(
    version: int, port: int, info: list[dict[str, Any]], bucket_bytes: int, *, timeout_seconds: int = 60
) -> dict[str, Any]:
    return {
        "version": version,
        "timeoutSeconds": timeout_seconds,
        "rendezvous": {
            "address": harness.TRAINER_ADDRESS,
            "port": port,
            "worldSize": 2,
            "rankOffset": 1,
            "trainerWorldSize": 1,
        },
        "refitInfo": info,
        "bucketBytes": bucket_bytes,
    }


def post_nemo(served: harness.InProcessEngine, body: Mapping[str, Any]) -> httpx.Response:
    with served.agent.client() as agent:
        return agent.post("/v1/refit/nemo", json=body)


def wait_phase(served: harness.InProcessEngine, phase: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        status = served.agent.status()
        if status["phase"] == phase:
            return status
        assert status["phase"] not in ("succeeded", "failed"), status
        assert time.monotonic() < deadline, f"the refit did not reach {phase}: {status}"
        time.sleep(harness.REFIT_POLL_SECONDS)  # polling an HTTP status with a deadline


def test_refits_over_one_nemo_world_write_in_place_and_serve_each_version(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    live = served.backend.parameters()
    pointers = {name: tensor.data_ptr() for name, tensor in live.items()}
    original = {name: tensor.clone() for name, tensor in live.items()}
    before, header = harness.completion_ids(served.frontend_url, PROMPT, 8)
    expected = trainer.greedy(PROMPT, 8)
    assert header == "0" and before != expected, "the trainer's weights must change the output"
    weights = trainer.weights()
    total = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    bucket_bytes = total // 4  # several buckets, tensors of mixed sizes
    nemo = nemo_trainer.AgentTrainer(weights, bucket_bytes)
    try:
        accepted = post_nemo(served, nemo_body(5, nemo.port, refit_info(weights), bucket_bytes))
        assert accepted.status_code == 202, accepted.text
        assert (accepted.json()["source"], accepted.json()["rank"]) == ("nemo", 1)
        first = served.agent.wait_finished(WAIT_SECONDS)

        assert first["phase"] == "succeeded", first
        assert (first["version"], first["worldSize"], first["error"], first["reused"]) == (5, 2, None, False)
        assert [phase["name"] for phase in first["phases"]] == ["suspend", "join", "receive", "resume"]
        assert first["bytesReceived"] == total and first["buckets"] == len(nemo.sent) >= 3
        assert first["tensorsWritten"] == len(live)
        assert (first["state"], first["weightVersion"], first["dirty"]) == ("ready", 5, False)
        for name, tensor in served.backend.parameters().items():
            assert tensor.data_ptr() == pointers[name], f"{name} was rebound"
            assert torch.equal(tensor, weights[name]), name
        assert harness.completion_ids(served.frontend_url, PROMPT, 8) == (expected, "5")
        assert served.refits.parked, "the membership of NeMo's world is kept for the next refit"

        # the next step: the engine's original weights again, over the same world, no new join
        nemo.send(original)
        accepted = post_nemo(served, nemo_body(6, nemo.port, refit_info(weights), bucket_bytes))
        assert accepted.status_code == 202, accepted.text
        second = served.agent.wait_finished(WAIT_SECONDS)
    finally:
        nemo.finish()

    assert second["phase"] == "succeeded" and second["reused"], second
    assert [phase["name"] for phase in second["phases"]] == ["suspend", "receive", "resume"], "no new join"
    assert second["bytesReceived"] == total and sum(nemo.sent) == 2 * total
    for name, tensor in served.backend.parameters().items():
        assert tensor.data_ptr() == pointers[name] and torch.equal(tensor, original[name]), name
    assert harness.completion_ids(served.frontend_url, PROMPT, 8) == (before, "6")


def test_a_refit_info_that_lacks_a_parameter_is_refused_and_the_engine_keeps_serving(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    original = {name: tensor.clone() for name, tensor in served.backend.parameters().items()}
    before = harness.completion_ids(served.frontend_url, PROMPT, 6)
    weights = trainer.weights()
    del weights["model.norm.weight"]
    refused = post_nemo(served, nemo_body(3, harness.free_port(), refit_info(weights), 4096))

    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "invalid_refit" and error["type"] == "invalid_request_error"
    assert "NeMo's refit info does not fit this engine" in error["message"]
    assert "lacks 1 parameters this rank holds" in error["message"] and "model.norm.weight" in error["message"]
    status = served.agent.status()
    assert (status["phase"], status["state"], status["weightVersion"], status["dirty"]) == ("idle", "ready", 0, False)
    for name, tensor in served.backend.parameters().items():
        assert torch.equal(tensor, original[name]), f"{name} changed although the refit was refused"
    assert harness.completion_ids(served.frontend_url, PROMPT, 6) == before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bucketBytes": None}, "bucketBytes: Field required"),
        ({"refitInfo": []}, "refitInfo: List should have at least 1 item"),
        ({"duplicate": True}, "refitInfo names 1 tensors twice"),
        ({"dtype": "float33"}, "unknown dtype 'float33'"),
        ({"dtype": "float32; rm"}, "refitInfo.0.dtype: String should match pattern"),
        ({"rendezvous": {"worldSize": 3, "rankOffset": 1, "trainerWorldSize": 2}}, "rankOffset 1 is a trainer rank"),
        ({"rendezvous": {"worldSize": 2, "rankOffset": 2}}, "rank 2 is not an inference rank (1..1)"),
        ({"generation": "megatron"}, "generation: Input should be 'nemo' or 'vllm'"),
    ],
    ids=["no-bucket-bytes", "no-refit-info", "duplicate", "unknown-dtype", "bad-dtype", "trainer-rank", "past-world",
         "generation"],
)  # fmt: skip
def test_nemo_requests_that_cannot_be_taken_are_refused_clearly(
    served: harness.InProcessEngine, trainer: harness.Trainer, change: dict[str, Any], message: str
) -> None:
    info = refit_info(trainer.weights())
    body = nemo_body(1, harness.free_port(), info, 4096)
    if change.get("duplicate"):
        info.append(dict(info[0]))
    elif "dtype" in change:
        info[0]["dtype"] = change["dtype"]
    elif "rendezvous" in change:
        body["rendezvous"].update(change["rendezvous"])
    else:
        body.update(change)
    body = {key: value for key, value in body.items() if value is not None}
    response = post_nemo(served, body)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error
    assert served.agent.status()["phase"] == "idle"


def test_an_abort_ends_a_nemo_refit_that_waits_for_the_trainers_buckets(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    weights = trainer.weights()
    nemo = nemo_trainer.AgentTrainer({}, 4096)  # joins, then sends nothing until told
    try:
        accepted = post_nemo(served, nemo_body(4, nemo.port, refit_info(weights), 4096, timeout_seconds=5))
        assert accepted.status_code == 202, accepted.text
        assert nemo.joined.wait(WAIT_SECONDS)
        wait_phase(served, "receiving")
        with served.agent.client() as agent:
            started = time.monotonic()
            aborted = agent.post("/v1/refit/abort", json={"reason": "the trainer died"}).json()
            assert time.monotonic() - started < 2, "abort answers at once, even while the attempt waits"
    finally:
        nemo.finish()

    assert (aborted["phase"], aborted["error"], aborted["state"]) == ("failed", "aborted: the trainer died", "stale")
    assert not aborted["dirty"] and aborted["bytesReceived"] == 0
    assert served.refits.wait_settled(harness.SETTLE_TIMEOUT_SECONDS)
    assert not served.refits.parked, "an aborted refit keeps no membership of NeMo's world"
    with served.agent.client() as agent:  # nothing was written: serving the old version is allowed
        assert agent.post("/v1/resume", json={}).json()["state"] == "ready"


def join_body(session: str, port: int) -> dict[str, Any]:
    """``POST /v1/refit/nemo/join``: NeMo's world as ``init_collective`` got it, this engine as rank 1."""
    rendezvous = {"address": harness.TRAINER_ADDRESS, "port": port, "worldSize": 2, "rankOffset": 1}
    return {"session": session, "rendezvous": rendezvous, "timeoutSeconds": 60}


def session_body(version: int, session: str, info: list[dict[str, Any]], bucket_bytes: int) -> dict[str, Any]:
    """``POST /v1/refit/nemo`` in its session form: no rendezvous, the joined world."""
    return {
        "version": version,
        "session": session,
        "timeoutSeconds": 60,
        "refitInfo": info,
        "bucketBytes": bucket_bytes,
    }


def wait_world(served: harness.InProcessEngine, phase: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        world = served.agent.status()["world"]
        if world is not None and world["phase"] == phase:
            return dict(world)
        assert world is None or world["phase"] not in ("failed", "left"), world
        assert time.monotonic() < deadline, f"the world did not reach {phase}: {world}"
        time.sleep(harness.REFIT_POLL_SECONDS)  # polling an HTTP status with a deadline


def test_a_join_at_init_collective_time_serves_on_and_session_refits_reuse_it(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    live = served.backend.parameters()
    pointers = {name: tensor.data_ptr() for name, tensor in live.items()}
    original = {name: tensor.clone() for name, tensor in live.items()}
    before, _ = harness.completion_ids(served.frontend_url, PROMPT, 8)
    expected = trainer.greedy(PROMPT, 8)
    weights = trainer.weights()
    info = refit_info(weights)
    total = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    bucket_bytes = total // 4
    nemo = nemo_trainer.AgentTrainer({}, bucket_bytes)  # NeMo's setup: the store waits for every rank; no refit yet
    try:
        assert not nemo.joined.wait(0.5), "the trainer's init_collective must wait for the engine"
        with served.agent.client() as agent:
            joining = agent.post("/v1/refit/nemo/join", json=join_body("grpo-7", nemo.port))
        assert joining.status_code == 202, joining.text
        assert (joining.json()["session"], joining.json()["rank"]) == ("grpo-7", 1)
        assert nemo.joined.wait(WAIT_SECONDS), "the trainer's init_collective returns once the engine joined"
        world = wait_world(served, "joined")
        assert (world["generation"], world["error"]) == ("nemo", None)
        status = served.agent.status()
        assert (status["phase"], status["state"], status["weightVersion"]) == ("idle", "ready", 0), "nothing suspended"
        assert harness.completion_ids(served.frontend_url, PROMPT, 8) == (before, "0"), "it served on while joined"

        for version, sent in ((5, weights), (6, original)):  # per step: the trainer broadcasts, the fleet receives
            nemo.send(sent)
            accepted = post_nemo(served, session_body(version, "grpo-7", info, bucket_bytes))
            assert accepted.status_code == 202, accepted.text
            done = served.agent.wait_finished(WAIT_SECONDS)
            assert done["phase"] == "succeeded" and done["reused"], done
            assert [phase["name"] for phase in done["phases"]] == ["suspend", "receive", "resume"], "never joins"
            assert done["bytesReceived"] == total and done["world"]["phase"] == "joined"
            for name, tensor in served.backend.parameters().items():
                assert tensor.data_ptr() == pointers[name] and torch.equal(tensor, sent[name]), name
            assert harness.completion_ids(served.frontend_url, PROMPT, 8) == (
                expected if version == 5 else before,
                str(version),
            )
    finally:
        nemo.finish()
    assert sum(nemo.sent) == 2 * total


def test_a_session_refit_without_a_joined_world_is_refused_with_409(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    info = refit_info(trainer.weights())
    refused = post_nemo(served, session_body(1, "grpo-7", info, 4096))

    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "nemo_not_joined" and "POST /v1/refit/nemo/join" in error["message"], error
    status = served.agent.status()
    assert (status["phase"], status["state"], status["world"]) == ("idle", "ready", None)


def test_an_abort_ends_a_join_that_waits_for_the_trainers_other_ranks(served: harness.InProcessEngine) -> None:
    port = harness.free_port()
    store_up = threading.Event()

    def master() -> None:  # NeMo's rank 0 of a world of 3 whose rank 2 never comes: it waits, then times out
        with contextlib.suppress(RuntimeError):
            store_up.set()
            c10d.TCPStore(harness.TRAINER_ADDRESS, port, 3, True, datetime.timedelta(seconds=5), wait_for_workers=True)

    with nemo_trainer.running(master) as failures:
        assert store_up.wait(WAIT_SECONDS)
        body = join_body("grpo-8", port)
        body["rendezvous"]["worldSize"] = 3
        with served.agent.client() as agent:
            started = time.monotonic()
            assert agent.post("/v1/refit/nemo/join", json=body).status_code == 202
            assert time.monotonic() - started < 2, "the join runs on its own thread, never on the agent's loop"
            assert wait_world(served, "joining")["session"] == "grpo-8"
            assert harness.completion_ids(served.frontend_url, PROMPT, 4)[1] == "0", "it serves while it joins"
            agent.post("/v1/refit/abort", json={"reason": "the trainer died"})
        world = served.agent.status()["world"]
        deadline = time.monotonic() + WAIT_SECONDS
        while world["phase"] == "joining" and time.monotonic() < deadline:
            time.sleep(harness.REFIT_POLL_SECONDS)  # polling an HTTP status with a deadline
            world = served.agent.status()["world"]
    assert not failures, failures
    assert world["phase"] == "failed" and "abort" in world["error"], world
    refused = post_nemo(served, session_body(1, "grpo-8", refit_info(served.backend.parameters()), 4096))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "nemo_not_joined", refused.text
    assert served.agent.status()["state"] == "ready"


def wait_store(served: harness.InProcessEngine, reachable: bool) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        world = served.agent.status()["world"]
        if world is not None and world["storeReachable"] is reachable:
            return dict(world)
        assert time.monotonic() < deadline, f"the store probe did not report {reachable}: {world}"
        time.sleep(harness.REFIT_POLL_SECONDS)  # polling an HTTP status with a deadline


def test_a_leave_drops_the_joined_world_the_engine_serves_on_and_a_second_leave_changes_nothing(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    served.refits.store_probe_seconds = 0.2
    before, _ = harness.completion_ids(served.frontend_url, PROMPT, 6)
    nemo = nemo_trainer.AgentTrainer({}, 4096)
    try:
        with served.agent.client() as agent:
            assert agent.post("/v1/refit/nemo/join", json=join_body("grpo-9", nemo.port)).status_code == 202
            assert nemo.joined.wait(WAIT_SECONDS)
            wait_world(served, "joined")
            assert wait_store(served, True)["session"] == "grpo-9", "the probe finds the trainer's store"
            left = agent.post("/v1/refit/nemo/leave", json={"session": "grpo-9"})
            again = agent.post("/v1/refit/nemo/leave", json={"session": "grpo-9"})
            other = agent.post("/v1/refit/nemo/leave", json={"session": "never-joined"})
    finally:
        nemo.finish()

    assert left.status_code == 200 and left.json()["phase"] == "left", left.text
    assert (again.status_code, again.json()["phase"], again.json()["session"]) == (200, "left", "grpo-9")
    assert (other.status_code, other.json()["phase"], other.json()["session"]) == (200, "left", "never-joined")
    status = served.agent.status()
    assert status["world"]["phase"] == "left" and status["world"]["error"] is None, status["world"]
    assert (status["phase"], status["state"], status["weightVersion"]) == ("idle", "ready", 0), "nothing suspended"
    assert not served.refits.parked, "the membership is dropped"
    assert harness.completion_ids(served.frontend_url, PROMPT, 6) == (before, "0"), "it serves on"
    refused = post_nemo(served, session_body(1, "grpo-9", refit_info(trainer.weights()), 4096))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "nemo_not_joined", refused.text


def test_a_leave_ends_a_join_in_progress_as_left_not_failed(served: harness.InProcessEngine) -> None:
    port = harness.free_port()
    store_up = threading.Event()

    def master() -> None:  # NeMo's rank 0 of a world of 3 whose rank 2 never comes
        with contextlib.suppress(RuntimeError):
            store_up.set()
            c10d.TCPStore(harness.TRAINER_ADDRESS, port, 3, True, datetime.timedelta(seconds=5), wait_for_workers=True)

    with nemo_trainer.running(master) as failures:
        assert store_up.wait(WAIT_SECONDS)
        body = join_body("grpo-10", port)
        body["rendezvous"]["worldSize"] = 3
        with served.agent.client() as agent:
            assert agent.post("/v1/refit/nemo/join", json=body).status_code == 202
            wait_world(served, "joining")
            left = agent.post("/v1/refit/nemo/leave", json={"session": "grpo-10"})
    assert not failures, failures
    assert left.status_code == 200 and left.json()["phase"] == "left", left.text
    assert served.refits.wait_settled(harness.SETTLE_TIMEOUT_SECONDS)
    world = served.agent.status()["world"]
    assert (world["phase"], world["error"]) == ("left", None), world


def test_the_store_probe_reports_the_trainers_store_gone_once_the_trainer_exits(
    served: harness.InProcessEngine,
) -> None:
    served.refits.store_probe_seconds = 0.2
    nemo = nemo_trainer.AgentTrainer({}, 4096)
    try:
        with served.agent.client() as agent:
            assert agent.post("/v1/refit/nemo/join", json=join_body("grpo-11", nemo.port)).status_code == 202
        assert nemo.joined.wait(WAIT_SECONDS)
        wait_world(served, "joined")
        assert wait_store(served, True)["phase"] == "joined"
    finally:
        nemo.finish()  # the trainer's ranks return: its store closes with them

    world = wait_store(served, False)
    assert (world["session"], world["phase"]) == ("grpo-11", "joined"), "an unreachable store is reported, not acted on"
    assert served.agent.status()["state"] == "ready"


def test_session_refits_with_integrity_report_each_buckets_digest_and_name_a_non_finite_tensor(
    served: harness.InProcessEngine, trainer: harness.Trainer
) -> None:
    """``integrity: checksum`` over NeMo's wire (which carries no digest): the status lists every
    bucket's ``mf64`` for the operator to compare across members, and a tensor arriving with NaN
    fails the refit naming it."""
    weights = trainer.weights()
    info = refit_info(weights)
    total = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    bucket_bytes = total // 4
    poisoned = {name: tensor.clone() for name, tensor in weights.items()}
    poisoned["model.norm.weight"][3] = float("nan")
    nemo = nemo_trainer.AgentTrainer({}, bucket_bytes)
    try:
        with served.agent.client() as agent:
            assert agent.post("/v1/refit/nemo/join", json=join_body("grpo-9", nemo.port)).status_code == 202
        wait_world(served, "joined")
        nemo.send(weights)
        body = session_body(5, "grpo-9", info, bucket_bytes) | {"integrity": "checksum"}
        assert post_nemo(served, body).status_code == 202
        verified = served.agent.wait_finished(WAIT_SECONDS)
        nemo.send(poisoned)
        assert post_nemo(served, body | {"version": 6}).status_code == 202
        failed = served.agent.wait_finished(WAIT_SECONDS)
    finally:
        nemo.finish()

    assert verified["phase"] == "succeeded", verified
    specs = nemo_protocol.refit_info({name: (tensor.shape, tensor.dtype) for name, tensor in weights.items()})
    buckets = nemo_protocol.plan_buckets(specs, bucket_bytes)
    expected = [
        digest.hex_digest(digest.reference(b"".join(bits(weights[spec.name]) for spec in bucket), index))
        for index, bucket in enumerate(buckets)
    ]
    assert verified["verification"] == {
        "integrity": "checksum",
        "method": "agreement",
        "buckets": len(buckets),
        "mismatch": None,
        "bucketDigests": expected,
        "nonFinite": None,
    }
    assert (failed["phase"], failed["state"]) == ("failed", "stale"), failed
    assert "model.norm.weight" in failed["error"] and "1 non-finite values" in failed["error"]
    assert failed["verification"]["nonFinite"] == "model.norm.weight"
    holding = [index for index, bucket in enumerate(buckets) if "model.norm.weight" in {s.name for s in bucket}]
    got = failed["verification"]["bucketDigests"]
    assert len(got) == len(expected)
    changed = [index for index, (one, want) in enumerate(zip(got, expected, strict=True)) if one != want]
    assert changed == holding, "only the poisoned tensor's bucket has another digest"


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
