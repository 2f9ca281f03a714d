"""NeMo RL's own trainer-driven refits of a fleet, end to end (docs/proposals/0001-nemo-collective-refits.md,
docs/nemo-rl.md).

The real local control plane, the operator and two tiny CPU engine pods; NeMo RL's policy side is
:class:`helpers.nemo_trainer.PolicyWorkers` in a Ray actor (its own process: two trainer ranks, the
store master at rank 0, the unique id, the warm-up and NeMo's packed broadcasts over gloo); the test
plays GRPO with a local Ray and :class:`megafleet.sdk.nemo.MegafleetGeneration` through
``nemo_factory`` (``refit_wire="nemo"``): a world the fleet cannot field is refused before any
RefitSession exists; vLLM's legacy order (``init_collective`` -> ``prepare_refit_info`` -> per step
broadcast + update) refits versions 1..3, each served with the trainer's greedy tokens and logprobs;
then, after ``shutdown`` ended that session, the collective synchronizer's order
(``prepare_refit_info`` and ``get_collective_sender_spec`` first) refits once more over a new session.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from helpers import nemo_collector, nemo_serving, nemo_trainer, operator_env, refit_e2e, refit_harness
from megafleet.sdk import errors, nemo
from megafleet_dev import kube

WAIT = refit_e2e.WAIT
TRAINER_RANKS = 2
FLEET_RANKS = 2  # two shards of one rank
WORLD = TRAINER_RANKS + FLEET_RANKS
GPU_MEMORY = 7_500_000  # a "trainer GPU" whose NeMo bucket target (x 0.02) splits the tiny model in ~3 buckets
MAX_TOKENS = nemo_serving.MAX_TOKENS
REFIT_DEADLINE = 20  # spec.refit.timeoutSeconds of the wrong-bucket fleet
PROBE_SECONDS = 10  # the agents' probe of the trainer's store


def sessions(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/refitsessions"


def phase_in(*phases: str) -> Any:
    return lambda obj: (obj or {}).get("status", {}).get("phase") in phases


@pytest.fixture
def local_ray() -> Iterator[None]:
    with nemo_collector.local_ray():
        yield


def adapter(namespace: str, kubeconfig: Path, **options: Any) -> nemo.MegafleetGeneration:
    factory = nemo.nemo_factory(
        "tiny", namespace, kubeconfig=kubeconfig, addressing="pod", ready_timeout_s=WAIT, **options
    )
    config = {"generation": {"max_new_tokens": MAX_TOKENS, "temperature": 1.0, "_pad_token_id": 0}}
    return factory(config=config)


def test_nemos_own_trainer_refits_the_fleet_in_vllms_order_and_the_collective_synchronizers(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path, local_ray: None
) -> None:
    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet(refit={"bucketSizeMiB": 1}))
    generation = adapter(namespace, kubeconfig, trainer_gpu_memory_bytes=GPU_MEMORY)
    assert generation.handle.refit_wire == "nemo"
    policy: Any = ray.remote(num_cpus=0)(nemo_trainer.PolicyWorkers).remote(gpu_memory_bytes=GPU_MEMORY)
    try:
        assert generation.prepare_for_generation()
        assert generation.weight_version == 0

        # a world the fleet cannot field: refused before anything exists
        with pytest.raises(ValueError, match=r"inference world is 3 ranks .* 2 shards x 1 ranks = 2"):
            generation.init_collective(nemo_trainer.ADDRESS, 29400, WORLD + 1, train_world_size=TRAINER_RANKS)
        assert kube_admin.list(sessions(namespace))["items"] == []

        # GRPO's setup, vLLM's legacy order
        port = refit_harness.free_port(nemo_trainer.ADDRESS)
        futures_train = [policy.init_collective.remote(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)]
        futures_inference = generation.init_collective(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)
        assert all(ray.get(futures_train + futures_inference, timeout=WAIT))
        generation.prepare_refit_info(ray.get(policy.prepare_refit_info.remote()))
        [session] = kube_admin.list(sessions(namespace))["items"]
        assert session["status"]["phase"] == "Joined"
        assert session["spec"]["nemoCollective"]["bucketBytes"] == int(GPU_MEMORY * 0.02)
        assert session["spec"]["refitInfo"]["tensors"] == len(ray.get(policy.prepare_refit_info.remote()))

        for step in (1, 2, 3):  # refit_policy_generation, non-colocated: broadcast + update, then ray.get
            futures_train = [policy.broadcast_weights_for_collective.remote(step)]
            futures_inference = generation.update_weights_from_collective()
            assert ray.get(futures_train, timeout=WAIT)[0] >= 3  # several buckets
            assert all(ray.get(futures_inference))
            assert generation.weight_version == step
            nemo_serving.check_serves(generation, step, version=step)
        generation.shutdown()
        kube_admin.wait_items(
            sessions(namespace), lambda items: not items, timeout=WAIT, what="the session deleted at shutdown"
        )
    finally:
        generation.shutdown()
        failures = ray.get(policy.shutdown.remote(), timeout=WAIT)
        ray.kill(policy)
    assert failures == []

    # the collective synchronizer's order, on a new session: info and sender spec first
    generation = adapter(namespace, kubeconfig)  # no bucket option: the sender spec hands B out
    generation.prepare_refit_info(nemo_trainer.PolicyWorkers(bucket_bytes=1).prepare_refit_info())
    assert generation.get_inference_world_size() == FLEET_RANKS
    spec = generation.get_collective_sender_spec()
    assert spec.nccl_peer == "nemo" and spec.buffer_size_bytes == 1024 * 1024  # the fleet's bucketSizeMiB
    policy = ray.remote(num_cpus=0)(nemo_trainer.PolicyWorkers).remote(bucket_bytes=spec.buffer_size_bytes)
    try:
        port = refit_harness.free_port(nemo_trainer.ADDRESS)
        futures_train = [policy.init_collective.remote(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)]
        futures_inference = generation.init_collective(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)
        assert all(ray.get(futures_train + futures_inference, timeout=WAIT))
        # sync_weights
        spec = generation.get_collective_sender_spec()
        futures_train = [policy.broadcast_weights_for_collective.remote(4, buffer_size_bytes=spec.buffer_size_bytes)]
        futures_inference = generation.update_weights_from_collective()
        ray.get(futures_train, timeout=WAIT)
        assert all(ray.get(futures_inference))
        nemo_serving.check_serves(generation, 4, version=4)
    finally:
        generation.shutdown()
        failures = ray.get(policy.shutdown.remote(), timeout=WAIT)
        ray.kill(policy)
    assert failures == []
    refits = kube_admin.list(refit_e2e.refits(namespace))["items"]
    assert sorted((r["spec"]["version"], r["status"]["phase"]) for r in refits) == [
        (version, "Succeeded") for version in (1, 2, 3, 4)
    ]
    assert all("session" in r["spec"]["source"] for r in refits)


def test_a_wrong_bucket_size_breaks_the_refit_by_its_deadline_and_a_killed_trainer_closes_the_session(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path, local_ray: None
) -> None:
    fleets = refit_e2e.fleets(namespace)
    kube_admin.create(fleets, refit_e2e.tiny_fleet(refit={"bucketSizeMiB": 1, "timeoutSeconds": REFIT_DEADLINE}))
    told = int(GPU_MEMORY * 0.02) // 4  # the adapter's B: 7 buckets of the tiny model
    generation = adapter(namespace, kubeconfig, trainer_bucket_bytes=told)
    # the trainer packs with 4x the target (another ratio in its Ray runtime env): 3 buckets, so the
    # fleet waits for a 4th that never comes (the other way round, see docs/nemo-rl.md)
    policy: Any = ray.remote(num_cpus=0)(nemo_trainer.PolicyWorkers).remote(bucket_bytes=told * 4, timeout=WAIT)
    try:
        assert generation.prepare_for_generation()
        port = refit_harness.free_port(nemo_trainer.ADDRESS)
        futures_train = [policy.init_collective.remote(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)]
        futures_inference = generation.init_collective(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)
        assert all(ray.get(futures_train + futures_inference, timeout=WAIT))
        generation.prepare_refit_info(ray.get(policy.prepare_refit_info.remote()))
        [session] = kube_admin.list(sessions(namespace))["items"]
        name = session["metadata"]["name"]
        policy.broadcast_weights_for_collective.remote(1)  # its futures are the trainer's problem
        started = time.monotonic()
        with pytest.raises(errors.RefitFailed, match=rf"bucketBytes {told}") as failed:
            generation.update_weights_from_collective(refit_timeout_s=WAIT)
        elapsed = time.monotonic() - started
        assert elapsed < REFIT_DEADLINE + 30, elapsed  # the Refit's own deadline ended it, nothing hung
        assert "restart the job" in str(failed.value), failed.value
        broken = kube_admin.wait(f"{sessions(namespace)}/{name}", phase_in("Broken"), timeout=WAIT, what="Broken")
        assert broken is not None and (kube.condition(broken, "Broken") or {}).get("reason") == "RefitFailed"
        assert generation.weight_version == 0
    finally:
        generation.shutdown()
        ray.kill(policy)

    # a fresh world; a held kubectl scale; the trainer process dies: TrainerGone within the setting
    generation = adapter(namespace, kubeconfig, trainer_bucket_bytes=told)
    policy = ray.remote(num_cpus=0)(nemo_trainer.PolicyWorkers).remote(bucket_bytes=told)
    try:
        port = refit_harness.free_port(nemo_trainer.ADDRESS)
        futures_train = [policy.init_collective.remote(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)]
        futures_inference = generation.init_collective(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)
        assert all(ray.get(futures_train + futures_inference, timeout=WAIT))
        [session] = [s for s in kube_admin.list(sessions(namespace))["items"] if s["status"]["phase"] == "Joined"]
        name = session["metadata"]["name"]
        kube_admin.patch(f"{fleets}/tiny/scale", {"spec": {"replicas": 3}})
        assert kube_admin.wait(
            f"{fleets}/tiny",
            lambda o: "spec.replicas 3 waits" in (kube.condition(o, "RefitSessionHeld") or {}).get("message", ""),
            timeout=WAIT,
            what="RefitSessionHeld naming the scale",
        )
        ray.kill(policy)  # SIGKILL of the trainer's process: its store goes with it
        killed = time.monotonic()
        bound = operator_env.TRAINER_GONE_SECONDS + PROBE_SECONDS + 15  # + one probe + polls and writes
        closed = kube_admin.wait(
            f"{sessions(namespace)}/{name}", phase_in("Closed", "Broken"), timeout=bound, what="TrainerGone"
        )
        assert closed is not None and closed["status"]["phase"] == "Closed", closed
        assert (kube.condition(closed, "Joined") or {}).get("reason") == "TrainerGone", closed
        assert operator_env.TRAINER_GONE_SECONDS <= time.monotonic() - killed < bound
        assert kube_admin.wait(
            f"/api/v1/namespaces/{namespace}/pods/tiny-s2-p0", lambda o: o is not None, timeout=WAIT
        ), "the held scale is applied once the session closed"
    finally:
        generation.shutdown()
