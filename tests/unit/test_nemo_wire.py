"""The adapter's ``refit_wire="nemo"`` against a fake API server and a fake operator (no engines).

NeMo RL's policy workers send the weights; the adapter only makes the fleet the receiving ranks,
through a RefitSession, its refit-info ConfigMap and one Refit per version (proposal 0001, section 4).
Here :class:`~helpers.nemo_fakes.FakeOperator` (an in-memory API server) plays the operator:
a session joins, its refit info is accepted when the ConfigMap's bytes match the sha256, and a Refit
runs until the test releases it. Covered: NeMo RL's three call orders, calls that return only once
the Refit succeeded, an exception (never a ``False`` result) when it fails, the bucket target ``B``
in all four cases, ``W - T`` checked before anything exists, and the ConfigMap's content.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import pickle
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from helpers.nemo_fakes import FLEET, NAMESPACE, FakeOperator, fleet_object, install
from megafleet.sdk import errors, nemo
from megafleet.sdk.nemo import buckets, refit_info, refit_wire_nemo
from megafleet_protocol.refit import nemo as nemo_protocol

INFO = {
    "model.embed_tokens.weight": (torch.Size([64, 16]), torch.float32),
    "model.layers.0.mlp.up_proj.weight": ((32, 16), torch.bfloat16),
    "lm_head.weight": ([64, 16], "torch.float32"),
}

MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # results are plain booleans here
    monkeypatch.setattr(refit_wire_nemo, "POLL_SECONDS", 0.01)


@pytest.fixture
def operator(monkeypatch: pytest.MonkeyPatch) -> FakeOperator:
    return install(monkeypatch, fleet_object())


@pytest.fixture
def adapter_factory() -> Iterator[Callable[..., nemo.MegafleetGeneration]]:
    made: list[nemo.MegafleetGeneration] = []

    def make(**options: Any) -> nemo.MegafleetGeneration:
        made.append(nemo.nemo_factory(FLEET, NAMESPACE, **options)(config={"generation": {"_pad_token_id": 0}}))
        return made[-1]

    yield make
    for adapter in made:
        adapter.shutdown()


def creates(api: FakeOperator) -> dict[str, int]:
    return {verb: count for verb, count in api.writes.items() if verb.startswith("create")}


def update_into(generation_: nemo.MegafleetGeneration, returned: list[Any]) -> None:
    returned.append(generation_.update_weights_from_collective())


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- NeMo RL's call orders -----------------------------------------------------------------------


def test_vllm_order_joins_at_init_stores_the_info_and_each_update_returns_only_after_its_refit_succeeded(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory(trainer_bucket_bytes=5 * MIB)
    assert generation_.handle.refit_wire == "nemo"  # no weights= given: NeMo's own trainer sends
    futures_train: list[Any] = [True, True]
    assert futures_train + generation_.init_collective("10.0.0.1", 29500, 4, train_world_size=2) == [True] * 3
    [session] = operator.of("RefitSession")
    assert session["status"]["phase"] == "Joined"
    assert session["metadata"]["ownerReferences"][0] == {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "MegatronGeneration",
        "name": FLEET,
        "uid": "fleet-uid",
    }
    assert session["spec"]["fleetRef"] == {"name": FLEET}
    assert session["spec"]["nemoCollective"] == {
        "address": "10.0.0.1",
        "port": 29500,
        "worldSize": 4,
        "trainerWorldSize": 2,
        "bucketBytes": 5 * MIB,
    }
    assert "refitInfo" not in session["spec"]

    generation_.prepare_refit_info(INFO)
    [session] = operator.of("RefitSession")
    [config_map] = operator.of("ConfigMap")
    reference = session["spec"]["refitInfo"]
    stored = base64.b64decode(config_map["binaryData"][refit_info.KEY])
    assert reference["configMapRef"] == {"name": config_map["metadata"]["name"], "key": refit_info.KEY}
    assert reference["sha256"] == hashlib.sha256(stored).hexdigest() and reference["tensors"] == 3
    assert json.loads(gzip.decompress(stored)) == [
        ["model.embed_tokens.weight", [64, 16], "float32"],
        ["model.layers.0.mlp.up_proj.weight", [32, 16], "bfloat16"],
        ["lm_head.weight", [64, 16], "float32"],
    ]
    assert config_map["immutable"] is True
    assert config_map["metadata"]["ownerReferences"][0]["kind"] == "RefitSession"
    assert config_map["metadata"]["ownerReferences"][0]["name"] == session["metadata"]["name"]

    for expected_version in (5, 6, 7):
        operator.release.clear()
        returned: list[Any] = []
        call = threading.Thread(target=update_into, args=(generation_, returned))
        call.start()
        wait_for(
            lambda: any(r["status"].get("phase") == "Running" for r in operator.of("Refit") if "status" in r),
            "the Refit to run",
        )
        time.sleep(0.1)  # the adapter polls meanwhile: it must not return while the Refit runs
        assert call.is_alive() and returned == []
        operator.release.set()
        call.join(timeout=10)
        assert returned == [[True]]
        refit = next(r for r in operator.of("Refit") if r["spec"]["version"] == expected_version)
        assert refit["status"]["phase"] == "Succeeded"
        assert refit["spec"]["source"] == {"session": {"name": session["metadata"]["name"]}}
        assert generation_.weight_version == expected_version
    assert sorted(r["spec"]["version"] for r in operator.of("Refit")) == [5, 6, 7]

    generation_.shutdown()
    assert operator.of("RefitSession") == []  # deleted: the operator's finalizer makes the members leave


def test_collective_synchronizer_order_hands_out_b_and_the_session_uses_exactly_it(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory(trainer_gpu_memory_bytes=80 * 1024**3)  # would give another B
    generation_.prepare_refit_info(INFO)  # before init: kept until the session exists
    assert creates(operator) == {}
    assert generation_.get_inference_world_size() == 2  # 2 shards x 1 rank
    spec = generation_.get_collective_sender_spec()
    assert spec.nccl_peer == "nemo" and spec.buffer_size_bytes == 3 * MIB  # the fleet's bucketSizeMiB
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    assert generation_.get_collective_sender_spec().buffer_size_bytes == 3 * MIB  # sync_weights asks again
    [session] = operator.of("RefitSession")
    assert session["spec"]["nemoCollective"]["bucketBytes"] == 3 * MIB
    assert session["spec"]["refitInfo"]["tensors"] == 3
    assert [c["type"] for c in session["status"]["conditions"]] == ["RefitInfoAccepted"]
    assert generation_.update_weights_from_collective() == [True]
    assert [r["spec"]["version"] for r in operator.of("Refit")] == [5]


def test_megatron_synchronizer_order_creates_the_refit_at_suspend_and_waits_for_it_at_update(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory()  # megatronNative needs no bucket target
    generation_.init_collective("10.0.0.1", 29500, 4, train_world_size=2, refit_backend="gloo")
    [session] = operator.of("RefitSession")
    assert session["spec"]["megatronNative"] == {
        "address": "10.0.0.1",
        "port": 29500,
        "worldSize": 4,
        "trainerWorldSize": 2,
        "copyBackend": "gloo",
    }
    for version in (5, 6):
        operator.release.clear()
        generation_.suspend_for_refit()
        made_now = [r for r in operator.of("Refit") if r["spec"]["version"] == version]
        assert len(made_now) == 1  # at suspend, so the engines drain while the trainer offloads
        assert generation_.prepare_for_generation(tags=["weights"]) is True
        operator.release.set()
        assert generation_.update_weights_from_collective() == [True]
        assert generation_.prepare_for_generation(tags=["kv_cache"]) is True
        generation_.resume_after_refit()
    assert sorted(r["spec"]["version"] for r in operator.of("Refit")) == [5, 6]  # one Refit per refit


def test_a_second_init_collective_deletes_the_adapters_older_session(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory(trainer_bucket_bytes=MIB)
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    [first] = operator.of("RefitSession")
    generation_.init_collective("10.0.0.1", 29600, 3, train_world_size=1)
    [second] = operator.of("RefitSession")
    assert second["metadata"]["name"] != first["metadata"]["name"] and second["spec"]["nemoCollective"]["port"] == 29600


# -- failures: an exception naming the cause, before anything exists when it can be ----------------


def test_a_failed_session_refit_raises_with_the_broken_reason_and_the_restart_advice(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory(trainer_bucket_bytes=MIB)
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    generation_.prepare_refit_info(INFO)
    operator.break_with = ("MemberLost", "shard 1, pod tiny-s1-p0 restarted")
    with pytest.raises(errors.RefitFailed) as raised:
        generation_.update_weights_from_collective()
    message = str(raised.value)
    assert "is Broken (MemberLost: shard 1, pod tiny-s1-p0 restarted)" in message
    assert "restart the job from its last checkpoint" in message
    assert (
        f"likely cause: the trainer packs its buckets with another target than the session's bucketBytes {MIB}"
        in message
    )
    assert "NRL_REFIT_BUFFER_MEMORY_RATIO" in message and "trainer_bucket_bytes" in message
    assert generation_.weight_version != 5
    with pytest.raises(errors.RefitFailed, match="is Broken"):  # the next update, too: the session is lost
        generation_.update_weights_from_collective()


def test_a_session_that_fails_to_join_raises_at_init_collective(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    operator.session_phase = "Failed"
    generation_ = adapter_factory(trainer_bucket_bytes=MIB)
    with pytest.raises(errors.RefitFailed, match=r"is Failed .*JoinFailed.*restart the job"):
        generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)


@pytest.mark.parametrize(
    ("replicas", "tensor", "world_size", "message"),
    [
        (
            2,
            1,
            4,
            r"inference world is 3 ranks \(world_size 4 - train_world_size 1\); fleet tiny has 2 shards x 1 ranks = 2",
        ),
        (2, 2, 3, r"inference world is 2 ranks .* 2 shards x 2 ranks = 4: make NeMo RL's inference cluster 4 GPUs"),
    ],
)
def test_a_world_the_fleet_cannot_field_raises_before_any_object_exists(
    monkeypatch: pytest.MonkeyPatch,
    adapter_factory: Callable[..., nemo.MegafleetGeneration],
    replicas: int,
    tensor: int,
    world_size: int,
    message: str,
) -> None:
    api = install(monkeypatch, fleet_object(replicas=replicas, tensor=tensor))
    generation_ = adapter_factory(trainer_bucket_bytes=MIB)
    with pytest.raises(ValueError, match=message):
        generation_.init_collective("10.0.0.1", 29500, world_size, train_world_size=1)
    assert creates(api) == {} and api.of("RefitSession") == []


def test_refits_before_init_collective_or_with_weights_are_refused(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory(trainer_bucket_bytes=MIB)
    with pytest.raises(RuntimeError, match="call init_collective"):
        generation_.update_weights_from_collective()
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    with pytest.raises(RuntimeError, match="call prepare_refit_info"):
        generation_.update_weights_from_collective()
    with pytest.raises(ValueError, match="the trainer's policy sends the weights"):
        generation_.update_weights_from_collective(weights=lambda: iter(()))
    assert operator.of("Refit") == []


# -- the bucket target B -------------------------------------------------------------------------


def session_bucket(operator: FakeOperator) -> int:
    [session] = operator.of("RefitSession")
    return int(session["spec"]["nemoCollective"]["bucketBytes"])


def test_b_from_the_sender_spec_handed_out_wins_over_every_option(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory(trainer_gpu_memory_bytes=80 * 1024**3)
    handed = generation_.get_collective_sender_spec().buffer_size_bytes
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    assert handed == session_bucket(operator) == 3 * MIB


def test_b_from_trainer_bucket_bytes_is_exact_and_is_also_what_the_sender_spec_hands_out(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory(trainer_bucket_bytes=123_456_789, trainer_gpu_memory_bytes=80 * 1024**3)
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    assert session_bucket(operator) == 123_456_789
    assert generation_.get_collective_sender_spec().buffer_size_bytes == 123_456_789


@pytest.mark.parametrize(
    ("ratio", "memory", "expected"),
    [
        (None, 143_771_336_704, 2_875_426_734),  # an H200 at NeMo's default 0.02
        ("0.01", 80 * 1024**3, int(80 * 1024**3 * 0.01)),
        ("0.5", 80 * 1024**3, 5 * 1024**3),  # capped at 5 GiB, as NeMo's workers do
    ],
)
def test_b_from_the_trainer_gpu_memory_and_nemos_ratio(
    operator: FakeOperator,
    adapter_factory: Callable[..., nemo.MegafleetGeneration],
    monkeypatch: pytest.MonkeyPatch,
    ratio: str | None,
    memory: int,
    expected: int,
) -> None:
    if ratio is None:
        monkeypatch.delenv(buckets.RATIO_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(buckets.RATIO_VARIABLE, ratio)
    generation_ = adapter_factory(trainer_gpu_memory_bytes=memory)
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    assert session_bucket(operator) == expected == nemo_protocol.nemo_bucket_bytes(memory, float(ratio or 0.02))


@pytest.mark.parametrize(
    ("runtime_env", "warned"),
    [
        (None, None),  # Ray not initialised
        ({"env_vars": {"OTHER": "1"}}, None),
        ({"env_vars": {buckets.RATIO_VARIABLE: "0.02"}}, None),
        ({"env_vars": {buckets.RATIO_VARIABLE: "0.05"}}, "NRL_REFIT_BUFFER_MEMORY_RATIO=0.05 .* computes .* with 0.02"),
        ({"env_vars": {buckets.RATIO_VARIABLE: "lots"}}, "'lots', which is not a number"),
    ],
)
def test_the_ratio_check_compares_the_ray_runtime_env_with_the_drivers(
    runtime_env: dict[str, Any] | None, warned: str | None
) -> None:
    found = buckets.ratio_mismatch(0.02, runtime_env)
    if warned is None:
        assert found is None
    else:
        assert found is not None and re.search(warned, found), found


def test_a_computed_b_warns_when_the_ray_runtime_env_sets_another_ratio_and_an_exact_b_does_not(
    operator: FakeOperator,
    adapter_factory: Callable[..., nemo.MegafleetGeneration],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(buckets.RATIO_VARIABLE, raising=False)
    monkeypatch.setattr(buckets, "ray_runtime_env", lambda: {"env_vars": {buckets.RATIO_VARIABLE: "0.04"}})
    generation_ = adapter_factory(trainer_gpu_memory_bytes=80 * 1024**3)
    with pytest.warns(RuntimeWarning, match=r"Ray runtime env sets NRL_REFIT_BUFFER_MEMORY_RATIO=0\.04"):
        generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    assert session_bucket(operator) == int(80 * 1024**3 * 0.02)  # B still follows the driver's ratio
    exact = adapter_factory(trainer_bucket_bytes=MIB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact.init_collective("10.0.0.1", 29600, 3, train_world_size=1)


def test_ray_runtime_env_is_none_without_an_initialised_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert buckets.ray_runtime_env() is None

    class Context:
        runtime_env = {"env_vars": {buckets.RATIO_VARIABLE: "0.1"}}

    class Ray:
        initialised = False

        def is_initialized(self) -> bool:
            return self.initialised

        def get_runtime_context(self) -> Context:
            return Context()

    fake = Ray()
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert buckets.ray_runtime_env() is None
    fake.initialised = True
    assert buckets.ray_runtime_env() == {"env_vars": {buckets.RATIO_VARIABLE: "0.1"}}


def test_an_unknown_b_raises_naming_both_options_before_any_object_exists(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory()
    generation_.prepare_refit_info(INFO)
    with pytest.raises(ValueError, match=r"trainer_bucket_bytes=.*trainer_gpu_memory_bytes="):
        generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    assert creates(operator) == {}


# -- the refit info ------------------------------------------------------------------------------


def test_the_refit_info_encoding_is_deterministic_ordered_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    first, again = refit_info.encode(INFO), refit_info.encode(dict(INFO))
    assert first == again and first.tensors == 3
    assert refit_info.decode(first.gzipped)[1] == ("model.layers.0.mlp.up_proj.weight", [32, 16], "bfloat16")
    reordered = refit_info.encode(dict(reversed(list(INFO.items()))))
    assert reordered.sha256 != first.sha256  # the order is the wire's order
    many = {f"model.layers.{i}.mlp.experts.{i * 7919 % 1000}.up_proj.weight": ((i, 7), "bfloat16") for i in range(5000)}
    monkeypatch.setattr(refit_info, "MAX_GZIPPED_BYTES", 4096)  # the real bound is 1 MiB
    with pytest.raises(ValueError, match=r"lists 5000 tensors, \d+ bytes gzip'd: more than the 4096 bytes"):
        refit_info.encode(many)
    with pytest.raises(ValueError, match=r"is not \(shape, dtype\)"):
        refit_info.encode({"w": 3})


def test_a_pickled_copy_keeps_the_wire_and_its_options_and_holds_no_session(
    operator: FakeOperator, adapter_factory: Callable[..., nemo.MegafleetGeneration]
) -> None:
    generation_ = adapter_factory(trainer_bucket_bytes=MIB, join_timeout_s=100)
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    copy_ = pickle.loads(pickle.dumps(generation_))  # what NeMo RL's async collector actor receives
    try:
        assert copy_.handle == generation_.handle and copy_.handle.refit_wire == "nemo"
        assert copy_.handle.trainer_bucket_bytes == MIB and copy_.handle.join_timeout_s == 100
        assert not copy_.connected
        with pytest.raises(RuntimeError, match="call init_collective"):  # only the driver's copy refits
            copy_.update_weights_from_collective()
    finally:
        copy_.shutdown()
    assert len(operator.of("RefitSession")) == 1  # the copy's shutdown leaves the driver's session alone
