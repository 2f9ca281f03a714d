"""Megatron-native refits through the agent (``POST /v1/refit/megatron/join``, ``/v1/refit/megatron``,
``/v1/refit/megatron/leave``): the routes, their validation and refusals, and the state machine of the
join and of the swap attempts, on the tiny CPU engine with a fake megatron-core group in place of
``prepare_swap_model_weights``/``swap_model_weights`` (the real ones need megatron-core on a GPU:
tests/gpu/test_gpu_megatron_native.py). The fake swap writes a whole new weight version in place, as
megatron-core's does, so greedy tokens show which version the engine serves."""

from __future__ import annotations

import socket
import sys
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from helpers import engine_harness as harness
from helpers import megatron_trainer, refit_harness
from megafleet_engine.backends import transformers_backend
from megafleet_engine.backends.megatron import native_refit
from megafleet_engine.models import tiny
from megafleet_engine.refit_attempts import memberships
from megafleet_protocol.refit import parameter_digests

SOURCE = "tiny://llama"
PROMPT = [40, 41, 42, 43, 44]
WAIT_SECONDS = 30.0
SESSION = "grpo-1"


class FakeGroup:
    """megatron-core's refit group as the engine sees it: ``prepare`` and ``swap`` record the thread
    and the engine state they ran in; a swap writes ``versions[n]`` (the n-th swap's weights) in place,
    or fails, or blocks until the group is closed."""

    def __init__(self, model: torch.nn.Module, versions: Sequence[Mapping[str, torch.Tensor]]) -> None:
        self.model = model
        self.versions = versions
        self.prepared: list[str] = []
        self.swapped: list[str] = []
        self.fail: str | None = None
        self.block = False
        self.closed = threading.Event()
        self.engine_states: list[str] = []
        self.engine: Any = None

    def prepare(self) -> None:
        self.prepared.append(threading.current_thread().name)

    def swap(self) -> tuple[int, int]:
        self.swapped.append(threading.current_thread().name)
        if self.engine is not None:
            self.engine_states.append(self.engine.state)
        if self.fail is not None:
            raise RuntimeError(self.fail)
        if self.block:
            self.closed.wait(WAIT_SECONDS)
            raise RuntimeError("the refit group was shut down")
        weights = self.versions[len(self.swapped) - 1]
        nbytes = 0
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(weights[name])
                nbytes += parameter.numel() * parameter.element_size()
        return len(weights), nbytes

    def close(self) -> None:
        self.closed.set()


class FakeReceiver:
    """The backend's megatron-core receiver: ``connect`` waits for ``gate`` (the trainer's ranks
    arriving) and returns ``group``; ``reason`` is what :meth:`unsupported` says."""

    def __init__(self, group: FakeGroup) -> None:
        self.group = group
        self.reason: str | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.connect_error: str | None = None
        self.connects: list[dict[str, Any]] = []

    def unsupported(self) -> str | None:
        return self.reason

    def connect(self, **kwargs: Any) -> FakeGroup:
        self.connects.append(kwargs)
        assert self.gate.wait(WAIT_SECONDS)
        if self.connect_error is not None:
            raise RuntimeError(self.connect_error)
        return self.group


class SwappingBackend(transformers_backend.TransformersBackend):
    """The tiny transformers backend with a (fake) megatron-core receiver, as the megatron backend has."""

    receiver: FakeReceiver

    def native_receiver(self) -> FakeReceiver:
        return self.receiver


def versions() -> list[dict[str, torch.Tensor]]:
    """Weights of refits 1, 2, 3: other seeds, then the start's again."""
    return [tiny.reference_weights(f"{SOURCE}?seed={seed}") for seed in (1, 2, 0)]


@pytest.fixture
def swapping(tmp_path: Path) -> Iterator[tuple[harness.Served, FakeReceiver]]:
    yield from _swapping(tmp_path)


@pytest.fixture
def probing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[harness.Served, FakeReceiver]]:
    """:func:`swapping` with the store probed every 0.2 s (10 s in production)."""
    monkeypatch.setattr(memberships, "STORE_PROBE_SECONDS", 0.2)
    yield from _swapping(tmp_path)


def _swapping(tmp_path: Path) -> Iterator[tuple[harness.Served, FakeReceiver]]:
    model, tokenizer = tiny.build_tiny(SOURCE)
    backend = SwappingBackend(model, tokenizer, name=harness.MODEL, max_sequence_length=harness.MAX_SEQUENCE_LENGTH)
    group = FakeGroup(model, versions())
    backend.receiver = FakeReceiver(group)
    with harness.serve(backend, harness.token_file(tmp_path)) as served:
        group.engine = served.engine
        yield served, backend.receiver


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.Served]:
    """A transformers engine: no megatron-core model."""
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path)) as running:
        yield running


def join_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "session": SESSION,
        "rendezvous": {"address": "127.0.0.1", "port": 29600, "worldSize": 2, "rankOffset": 1, "trainerWorldSize": 1},
        "copyBackend": "gloo",
        "timeoutSeconds": 20,
    }
    body.update(extra)
    return body


def refit_body(version: int, **extra: Any) -> dict[str, Any]:
    return {"version": version, "session": SESSION, "timeoutSeconds": 20, **extra}


def post(served: harness.Served, path: str, body: Mapping[str, Any]) -> httpx.Response:
    with served.agent() as agent:
        return agent.post(path, json=body)


def world(served: harness.Served) -> dict[str, Any]:
    with served.agent() as agent:
        status: dict[str, Any] = agent.get("/v1/refit/status").json()
    return status["world"] or {}


def wait_world(served: harness.Served, *phases: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        current = world(served)
        if current.get("phase") in phases:
            return current
        assert time.monotonic() < deadline, f"the membership did not reach {phases}: {current}"
        time.sleep(0.02)  # polling the agent's status with a deadline, as the operator does


def refit(served: harness.Served, version: int, **extra: Any) -> dict[str, Any]:
    response = post(served, "/v1/refit/megatron", refit_body(version, **extra))
    assert response.status_code == 202, response.text
    return refit_harness.AgentClient(served.agent_url).wait_finished(WAIT_SECONDS)


def tokens(served: harness.Served) -> tuple[list[int], str]:
    return refit_harness.completion_ids(served.frontend_url, PROMPT, 8)


def assert_error(response: httpx.Response, status: int, code: str, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] and error["message"]
    for word in words:
        assert word in error["message"], error["message"]


# -- refusals ----------------------------------------------------------------------------------------


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_backend_without_a_megatron_core_model_cannot_swap(served: harness.Served) -> None:
    assert_error(
        post(served, "/v1/refit/megatron/join", join_body()), 409, "backend_cannot_swap", "TransformersBackend"
    )
    assert_error(post(served, "/v1/refit/megatron", refit_body(1)), 409, "backend_cannot_swap")
    assert served.engine.state == "ready" and world(served) == {}


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_an_old_megatron_core_is_refused_naming_its_version(
    swapping: tuple[harness.Served, FakeReceiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    served, receiver = swapping
    core = types.ModuleType("megatron.core")
    core.__version__ = "0.16.1"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    monkeypatch.setitem(sys.modules, "megatron.core", core)
    receiver.reason = native_refit.unsupported()
    assert receiver.reason is not None and "0.16.1" in receiver.reason and ">= 0.17" in receiver.reason
    assert_error(post(served, "/v1/refit/megatron/join", join_body()), 409, "backend_cannot_swap", "0.16.1")
    assert receiver.connects == []


@pytest.mark.parametrize(
    ("change", "word"),
    [
        ({"copyBackend": "nvshmem"}, "copyBackend"),
        (
            {"rendezvous": {"address": "a", "port": 1, "worldSize": 3, "rankOffset": 1, "trainerWorldSize": 2}},
            "rankOffset",
        ),
        ({"bucketBytes": 4}, "bucketBytes"),
        ({"session": ""}, "session"),
    ],
    ids=["copy-backend", "trainer-rank", "unknown-field", "empty-session"],
)
@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_bad_join_bodies_are_refused(served: harness.Served, change: dict[str, Any], word: str) -> None:
    response = post(served, "/v1/refit/megatron/join", join_body(**change))
    assert response.status_code == 400, response.text
    assert word in response.text


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_rank_outside_the_group_is_refused(swapping: tuple[harness.Served, FakeReceiver]) -> None:
    served, receiver = swapping
    rendezvous = {"address": "127.0.0.1", "port": 29600, "worldSize": 2, "rankOffset": 2, "trainerWorldSize": 1}
    assert_error(
        post(served, "/v1/refit/megatron/join", join_body(rendezvous=rendezvous)), 400, "invalid_refit", "1 .. 1"
    )
    assert receiver.connects == []


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_refit_never_joins(swapping: tuple[harness.Served, FakeReceiver]) -> None:
    served, receiver = swapping
    assert_error(post(served, "/v1/refit/megatron", refit_body(1)), 409, "megatron_not_joined", "join first")
    assert receiver.connects == [] and served.engine.state == "ready"


# -- the join --------------------------------------------------------------------------------------


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_join_prepares_on_the_backend_thread_while_the_engine_serves(
    swapping: tuple[harness.Served, FakeReceiver],
) -> None:
    served, receiver = swapping
    before, _ = tokens(served)
    receiver.gate.clear()  # the trainer's ranks have not arrived yet
    response = post(served, "/v1/refit/megatron/join", join_body())
    assert response.status_code == 202, response.text
    assert response.json()["phase"] == "joining" and response.json()["protocol"] == "megatron"
    assert tokens(served) == (before, "0"), "the engine serves while the join waits for the trainer"
    again = post(served, "/v1/refit/megatron/join", join_body())
    assert again.status_code == 202 and again.json()["phase"] == "joining"
    receiver.gate.set()
    joined = wait_world(served, "joined", "failed")
    assert joined == {**joined, "session": SESSION, "phase": "joined", "protocol": "megatron", "rank": 1}
    assert len(receiver.connects) == 1, "a repeated join answers the status, it does not join twice"
    assert receiver.connects[0] == {
        "address": "127.0.0.1",
        "port": 29600,
        "world_size": 2,
        "rank": 1,
        "rank_offset": 1,
        "copy_backend": "gloo",
        "timeout_seconds": 20,
    }
    assert receiver.group.prepared == ["megafleet-engine"]
    assert served.engine.state == "ready"


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_joined_membership_probes_the_trainers_store_at_port_plus_one(
    probing: tuple[harness.Served, FakeReceiver],
) -> None:
    served, _ = probing
    store = socket.create_server(("127.0.0.1", 0))  # megatron-core's refit store listens at port + 1
    port = store.getsockname()[1] - 1
    rendezvous = {"address": "127.0.0.1", "port": port, "worldSize": 2, "rankOffset": 1, "trainerWorldSize": 1}
    try:
        response = post(served, "/v1/refit/megatron/join", join_body(rendezvous=rendezvous))
        assert response.status_code == 202, response.text
        assert response.json().get("storeReachable") is None, "not probed before it joined"
        wait_world(served, "joined")
        assert wait_store(served, True)["session"] == SESSION
    finally:
        store.close()  # the trainer is gone: its store with it
    gone = wait_store(served, False)
    assert gone["phase"] == "joined", "the probe reports; the operator decides"


def wait_store(served: harness.Served, reachable: bool) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        current = world(served)
        if current.get("storeReachable") is reachable:
            return current
        assert time.monotonic() < deadline, f"the store probe did not report {reachable}: {current}"
        time.sleep(0.05)  # polling the agent's status with a deadline, as the operator does


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_failed_join_reports_why_and_refits_stay_refused(swapping: tuple[harness.Served, FakeReceiver]) -> None:
    served, receiver = swapping
    receiver.connect_error = "the trainer's store at 127.0.0.1:29601 did not answer"
    assert post(served, "/v1/refit/megatron/join", join_body()).status_code == 202
    failed = wait_world(served, "failed")
    assert "did not answer" in failed["error"]
    assert_error(post(served, "/v1/refit/megatron", refit_body(1)), 409, "megatron_not_joined", "failed")
    assert served.engine.state == "ready"


# -- the swaps -------------------------------------------------------------------------------------


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_swaps_suspend_write_in_place_and_serve_each_version(swapping: tuple[harness.Served, FakeReceiver]) -> None:
    served, receiver = swapping
    group = receiver.group
    original, _ = tokens(served)
    assert post(served, "/v1/refit/megatron/join", join_body()).status_code == 202
    wait_world(served, "joined")
    pointers = {name: p.data_ptr() for name, p in group.model.named_parameters()}
    seen = []
    for version in (1, 2, 3):
        status = refit(served, version)
        assert status["phase"] == "succeeded", status
        assert (status["version"], status["weightVersion"], status["state"]) == (version, version, "ready")
        assert (status["source"], status["transport"], status["rank"], status["worldSize"]) == ("nemo", "reshard", 1, 2)
        assert status["tensorsWritten"] == len(group.versions[0]) and status["bytesReceived"] > 0
        assert [phase["name"] for phase in status["phases"]] == ["suspend", "receive", "resume"]
        assert status["world"]["phase"] == "joined"
        seen.append(tokens(served))
    assert group.swapped == ["megafleet-engine"] * 3, "every swap runs on the backend thread"
    assert group.engine_states == ["suspended"] * 3, "nothing is served while megatron-core writes"
    assert {name: p.data_ptr() for name, p in group.model.named_parameters()} == pointers
    assert [version for _, version in seen] == ["1", "2", "3"]
    assert seen[0][0] != original and seen[1][0] != seen[0][0]
    assert seen[2][0] == original, "version 3 holds the start's weights again"
    again = post(served, "/v1/refit/megatron", refit_body(3))
    assert again.status_code == 202 and again.json()["phase"] == "succeeded" and len(group.swapped) == 3


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_swap_with_integrity_reports_the_digests_of_the_parameters_it_wrote(
    swapping: tuple[harness.Served, FakeReceiver],
) -> None:
    """megatron-core's reshard carries no digest: with ``integrity: checksum`` the rank digests its
    parameters after the swap, on the backend thread (the transformers backend stands in for megatron's:
    the same source and digest function), for the operator to compare across the shards."""
    served, receiver = swapping
    group = receiver.group
    assert post(served, "/v1/refit/megatron/join", join_body()).status_code == 202
    wait_world(served, "joined")
    checked = refit(served, 1, integrity="checksum")
    unchecked = refit(served, 2)
    back = refit(served, 3, integrity="checksum")

    assert [status["phase"] for status in (checked, unchecked, back)] == ["succeeded"] * 3
    for status, weights in ((checked, group.versions[0]), (back, group.versions[2])):
        expected = parameter_digests.digest_tensors(weights)  # the trainer's tensors, by name
        assert status["verification"] == {
            "integrity": "checksum",
            "method": "agreement",
            "buckets": expected.buckets,
            "mismatch": None,
            "bucketDigests": list(expected.bucket_digests),
            "nonFinite": None,
        }
    assert not (unchecked["verification"] or {}).get("bucketDigests"), "integrity none digests nothing"
    assert checked["verification"]["bucketDigests"] != back["verification"]["bucketDigests"]
    assert group.swapped == ["megafleet-engine"] * 3, "the digests ran where the swap did"


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_refit_for_another_session_is_refused(swapping: tuple[harness.Served, FakeReceiver]) -> None:
    served, _ = swapping
    assert post(served, "/v1/refit/megatron/join", join_body()).status_code == 202
    wait_world(served, "joined")
    response = post(served, "/v1/refit/megatron", {**refit_body(1), "session": "other"})
    assert_error(response, 409, "megatron_not_joined", "grpo-1", "other")


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_failed_swap_leaves_the_engine_stale_and_the_group_broken(
    swapping: tuple[harness.Served, FakeReceiver],
) -> None:
    served, receiver = swapping
    assert post(served, "/v1/refit/megatron/join", join_body()).status_code == 202
    wait_world(served, "joined")
    receiver.group.fail = "gloo: connection reset by peer"
    status = refit(served, 1)
    assert status["phase"] == "failed" and "connection reset" in status["error"], status
    assert status["state"] == "stale" and status["weightVersion"] == 0
    assert status["world"]["phase"] == "failed" and "cannot be reused" in status["world"]["error"]
    assert receiver.group.closed.wait(WAIT_SECONDS), "the broken group is closed"
    assert_error(post(served, "/v1/refit/megatron", refit_body(2)), 409, "megatron_not_joined", "failed")


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_swap_past_its_deadline_fails_and_closes_the_group(swapping: tuple[harness.Served, FakeReceiver]) -> None:
    served, receiver = swapping
    assert post(served, "/v1/refit/megatron/join", join_body()).status_code == 202
    wait_world(served, "joined")
    receiver.group.block = True  # the trainer never sends: megatron-core waits in its collective
    status = refit(served, 1, timeoutSeconds=1)
    assert status["phase"] == "failed" and status["timedOut"], status
    assert status["state"] == "stale"
    assert receiver.group.closed.wait(WAIT_SECONDS), "closing the group unblocks the stuck swap"
    assert wait_world(served, "failed")["error"]


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_leave_closes_the_group_and_is_idempotent(swapping: tuple[harness.Served, FakeReceiver]) -> None:
    served, receiver = swapping
    assert post(served, "/v1/refit/megatron/leave", {"session": SESSION}).json() == {"world": None}
    assert post(served, "/v1/refit/megatron/join", join_body()).status_code == 202
    wait_world(served, "joined")
    left = post(served, "/v1/refit/megatron/leave", {"session": SESSION})
    assert left.status_code == 200 and left.json()["world"]["phase"] == "left"
    assert receiver.group.closed.wait(WAIT_SECONDS)
    assert post(served, "/v1/refit/megatron/leave", {"session": SESSION}).json()["world"]["phase"] == "left"
    assert_error(post(served, "/v1/refit/megatron", refit_body(1)), 409, "megatron_not_joined", "left")
    assert served.engine.state == "ready"


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_leave_during_a_swap_aborts_it(swapping: tuple[harness.Served, FakeReceiver]) -> None:
    served, receiver = swapping
    assert post(served, "/v1/refit/megatron/join", join_body()).status_code == 202
    wait_world(served, "joined")
    receiver.group.block = True
    assert post(served, "/v1/refit/megatron", refit_body(1)).status_code == 202
    deadline = time.monotonic() + WAIT_SECONDS
    while not receiver.group.swapped:
        assert time.monotonic() < deadline, "the swap did not start"
        time.sleep(0.02)  # waiting for the backend thread to enter the swap, with a deadline
    assert post(served, "/v1/refit/megatron/leave", {"session": SESSION}).status_code == 200
    status = refit_harness.AgentClient(served.agent_url).wait_finished(WAIT_SECONDS)
    assert status["phase"] == "failed" and "left" in status["error"] and status["state"] == "stale"
    assert receiver.group.closed.is_set()


# -- the group handshake, with real process groups ------------------------------------------------


@pytest.mark.slow
def test_the_receiver_joins_the_group_nemos_synchronizer_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import distributed_c10d as c10d

    monkeypatch.setattr(native_refit, "unsupported", lambda: None)  # no megatron-core on this machine
    port = refit_harness.free_port() - 1  # the group's store listens at port + 1
    trainer: dict[str, Any] = {}

    def run_trainer() -> None:
        store, group = megatron_trainer.refit_group("127.0.0.1", port, 2, 0, timeout_seconds=WAIT_SECONDS)
        gathered: list[Any] = [None, None]
        torch.distributed.all_gather_object(gathered, "trainer metadata", group=group)
        trainer.update(store=store, group=group, gathered=gathered)

    thread = threading.Thread(target=run_trainer, daemon=True)
    thread.start()
    joined = native_refit.NativeRefit(model=None, device=0).connect(
        address="127.0.0.1", port=port, world_size=2, rank=1, rank_offset=1, copy_backend="gloo", timeout_seconds=20
    )
    gathered: list[Any] = [None, None]
    torch.distributed.all_gather_object(gathered, "engine metadata", group=joined.group)
    thread.join(WAIT_SECONDS)
    assert not thread.is_alive()
    assert gathered == trainer["gathered"] == ["trainer metadata", "engine metadata"]
    assert (joined.rank, joined.group.size(), joined.group.group_name) == (1, 2, "refit")
    assert c10d._world.pg_names[joined.group] == "refit" and c10d._world.pg_group_ranks[joined.group] == {0: 0, 1: 1}
    joined.close()
    assert joined.group not in c10d._world.pg_map and joined.group not in c10d._world.pg_names
    megatron_trainer.forget_group(trainer["group"])
