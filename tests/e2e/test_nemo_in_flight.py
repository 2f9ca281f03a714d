"""NeMo RL's async GRPO with in-flight weight updates, end to end (proposal 0003, sections 9 and 10;
docs/nemo-rl.md, "Refits while NeMo RL generates").

The real local control plane, the operator and two tiny CPU engine pods (a 2,048-token limit); the
test plays async GRPO's driver (``grpo.py``'s refit: the collector's ``prepare_for_refit``, the
refit, ``set_weight_version``, ``resume_after_refit``) with a local Ray, the adapter made by
``nemo_factory(..., master_config=...)`` and :class:`helpers.nemo_collector.Collector` as the
trajectory collector: a Ray actor holding a pickled copy, generating eight 600-token samples
(greedy, ``ignore_eos``; one ``generate_async`` call, so each engine runs its four as one batch)
while three refits land, each once the engines' token counters show the samples well under way.

* ``in_flight_weight_updates`` + ``recompute_kv_cache_after_weight_updates`` over NeMo's own
  collective (``refit_wire="nemo"``, NeMo's policy workers in a Ray actor): every Refit asks for
  ``inFlight: keep, kvCacheMode: recompute`` and reports it kept; ``invalidate_kv_cache()`` (asked by
  the collector's copy) is true after each; every sample spans the versions of the refits that
  landed while it ran, and each token's logprob is NeMo's processed logprob of a fresh forward pass
  at its span's version (and the greedy choice of it).
* ``in_flight_weight_updates`` alone over megafleet's own wire (the adapter sends ``weights=``): the
  Refits keep with the fleet's ``persist``; ``invalidate_kv_cache()`` is false; each token's logprob
  is the KV replay's (the new weights over the prefix KV of the old).

Run by the lead once the engine's keep and the operator's in-flight fields are merged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families

from helpers import nemo_collector, nemo_spans, nemo_trainer, refit_e2e, refit_harness
from megafleet.sdk import nemo
from megafleet_dev import kube
from megafleet_engine.models import tiny
from megafleet_protocol import ports

pytestmark = pytest.mark.timeout(600)

WAIT = refit_e2e.WAIT
TRAINER_RANKS = 2
WORLD = TRAINER_RANKS + 2  # two shards of one rank
GPU_MEMORY = 7_500_000  # NeMo's bucket target for it (x 0.02) splits the tiny model in ~3 buckets
LIMIT = 2048  # the tiny model's positions
NEW_TOKENS = 600  # long enough that the first refit lands mid-generation, short for CI's budget
PROMPTS = [[1, 40 + i, 41 + 2 * i, 42] for i in range(8)]  # four per shard (maxBatchSize 8)
REFITS = 3
PODS = ["tiny-s0-p0", "tiny-s1-p0"]


@pytest.fixture
def local_ray() -> Iterator[None]:
    with nemo_collector.local_ray():
        yield


def long_fleet(**spec: Any) -> dict[str, Any]:
    manifest = refit_e2e.tiny_fleet(**spec)
    manifest["spec"]["model"]["maxSequenceLength"] = LIMIT
    return manifest


def master_config(*, recompute: bool) -> dict[str, Any]:
    """Async GRPO's master config with the MegatronGeneration backend (``grpo.MegatronGeneration`` is
    the factory) and in-flight weight updates."""
    return {
        "policy": {
            "generation": {
                "backend": "megatron",
                "max_new_tokens": NEW_TOKENS,
                "temperature": 1.0,
                "ignore_eos": True,
                "_pad_token_id": 0,
            }
        },
        "grpo": {
            "async_grpo": {
                "enabled": True,
                "max_trajectory_age_steps": REFITS + 1,
                "in_flight_weight_updates": True,
                "recompute_kv_cache_after_weight_updates": recompute,
            }
        },
    }


def engines(kube_admin: kube.Kube, namespace: str) -> tuple[int, int]:
    """(tokens generated, sequences running) summed over the fleet's engines (their Prometheus metrics)."""
    generated = running = 0
    for pod in PODS:
        found = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
        assert found is not None
        text = httpx.get(f"http://{found['status']['podIP']}:{ports.METRICS_PORT}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "megafleet_generated_tokens_total":
                    generated += int(sample.value)
                elif sample.name == "megafleet_running_sequences":
                    running += int(sample.value)
    return generated, running


def wait_generated(kube_admin: kube.Kube, namespace: str, tokens: int, what: str) -> None:
    """Until the engines generated ``tokens`` in all (polling their counters), with samples running."""
    deadline = time.monotonic() + WAIT
    while True:
        generated, running = engines(kube_admin, namespace)
        if generated >= tokens:
            assert running == len(PROMPTS), f"{what}: {running} sequences running after {generated} tokens"
            return
        assert time.monotonic() < deadline, f"{what}: {generated} of {tokens} tokens after {WAIT} s"
        time.sleep(0.05)


def step_models() -> dict[int, Any]:
    """The policy's weights at each version: the fleet's own at 0, the trainer's step ``v`` after."""
    return {
        version: tiny.build_tiny("tiny://llama" if version == 0 else nemo_trainer.step_source(version))[0]
        for version in range(REFITS + 1)
    }


def async_grpo(
    kube_admin: kube.Kube,
    namespace: str,
    generation: nemo.MegafleetGeneration,
    master: dict[str, Any],
    refit: Any,
) -> tuple[list[dict[str, Any]], list[int], Any]:
    """Async GRPO's loop around one long batch: ``refit(step)`` does the weight sync of step ``step``
    once the samples are a step further on. Returns the samples, the sequences still running after
    each refit, and the collector (still alive)."""
    collector: Any = ray.remote(nemo_collector.Collector).remote(generation, master)
    ray.get(collector.set_weight_version.remote(0))
    before, _ = engines(kube_admin, namespace)
    batch = ray.get(collector.start.remote(PROMPTS, together=True))  # each engine starts its four at once
    running_after = []
    for step in range(1, REFITS + 1):
        per_sample = step * NEW_TOKENS // (REFITS + 2)  # 120, 240, 360 of 600
        wait_generated(kube_admin, namespace, before + per_sample * len(PROMPTS), f"before refit {step}")
        ray.get(collector.prepare_for_refit.remote(), timeout=WAIT)  # in flight: returns at once
        refit(step)
        ray.get(collector.set_weight_version.remote(step))
        ray.get(collector.resume_after_refit.remote(), timeout=WAIT)
        running_after.append(engines(kube_admin, namespace)[1])
    rows = ray.get(collector.finish.remote(batch), timeout=WAIT * 2)
    return rows, running_after, collector


def check_samples(rows: list[dict[str, Any]], running_after: list[int], kv: nemo_spans.KvMode) -> None:
    """Versions and logprobs of every sample against the reference at each token's version."""
    assert running_after[0] == len(PROMPTS), running_after  # the first refit landed mid-generation
    models = step_models()
    for prompt, row in zip(PROMPTS, rows, strict=True):
        versions = row["token_weight_versions"]
        assert len(row["tokens"]) == len(versions) == NEW_TOKENS and row["truncated"]  # ran to its budget
        assert versions == sorted(versions) and versions[0] == 0, "versions only go up, from the first"
        assert set(versions) == set(range(versions[-1] + 1)), "no version skipped"
        landed = {step for step, running in enumerate(running_after, start=1) if running == len(PROMPTS)}
        assert landed <= set(versions), (landed, sorted(set(versions)))  # both sides of every refit that landed
        assert (row["weight_version"], row["last_weight_version"]) == (0, versions[-1])
        assert row["generation_weight_version"] == 0  # NeMo's stamp: the version its generation started at
        expected, best = nemo_spans.logprobs(models, prompt, row["tokens"], versions, kv)
        assert (expected >= best - 1e-4).all(), ("not greedy at its version", prompt, nemo_spans.runs(versions))
        served = torch.tensor(row["logprobs"])
        assert torch.allclose(served, expected, atol=1e-4), (prompt, float((served - expected).abs().max()))


def refits_of(kube_admin: kube.Kube, namespace: str) -> list[dict[str, Any]]:
    found = kube_admin.list(refit_e2e.refits(namespace))["items"]
    return sorted(found, key=lambda refit: refit["spec"]["version"])


def test_async_grpo_in_flight_with_kv_recompute_keeps_generations_through_refits_over_nemos_collective(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path, local_ray: None
) -> None:
    kube_admin.create(refit_e2e.fleets(namespace), long_fleet(refit={"bucketSizeMiB": 1}))
    master = master_config(recompute=True)
    factory = nemo.nemo_factory(
        "tiny",
        namespace,
        kubeconfig=kubeconfig,
        addressing="pod",
        ready_timeout_s=WAIT,
        trainer_gpu_memory_bytes=GPU_MEMORY,
        master_config=master,
    )
    generation = factory(config=master["policy"])  # GRPO's setup hands over policy.generation only
    policy: Any = ray.remote(num_cpus=0)(nemo_trainer.PolicyWorkers).remote(gpu_memory_bytes=GPU_MEMORY)
    try:
        assert generation.handle.refit_wire == "nemo" and generation.prepare_for_generation()
        port = refit_harness.free_port(nemo_trainer.ADDRESS)
        futures_train = [policy.init_collective.remote(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)]
        futures_inference = generation.init_collective(nemo_trainer.ADDRESS, port, WORLD, train_world_size=2)
        assert all(ray.get(futures_train + futures_inference, timeout=WAIT))
        generation.prepare_refit_info(ray.get(policy.prepare_refit_info.remote()))

        def refit(step: int) -> None:  # refit_policy_generation, non-colocated
            futures_train = [policy.broadcast_weights_for_collective.remote(step)]
            futures_inference = generation.update_weights_from_collective(refit_timeout_s=WAIT)
            ray.get(futures_train, timeout=WAIT)
            assert all(ray.get(futures_inference))

        rows, running_after, collector = async_grpo(kube_admin, namespace, generation, master, refit)
        try:
            invalidations, waited = ray.get(collector.refit_record.remote())
            metrics = ray.get(collector.metrics.remote())
        finally:
            ray.kill(collector)
    finally:
        generation.shutdown()
        failures = ray.get(policy.shutdown.remote(), timeout=WAIT)
        ray.kill(policy)
    assert failures == []

    refits = refits_of(kube_admin, namespace)
    assert [(r["spec"]["version"], r["status"]["phase"]) for r in refits] == [(v, "Succeeded") for v in (1, 2, 3)]
    for refit_obj in refits:
        assert (refit_obj["spec"]["inFlight"], refit_obj["spec"]["kvCacheMode"]) == ("keep", "recompute")
        in_flight = refit_obj["status"]["inFlight"]
        assert (in_flight["effective"], in_flight["kvCacheMode"]) == ("keep", "recompute"), in_flight
    assert (invalidations, waited) == ([True] * REFITS, 0)  # no wait for NeMo's generations; KV recomputed
    check_samples(rows, running_after, "recompute")
    spanning = [row for row in rows if len(set(row["token_weight_versions"])) > 1]
    assert len(spanning) == len(PROMPTS)
    assert metrics["megafleet/samples_spanning_refit"] == len(spanning)
    assert metrics["megafleet/tokens_older_than_latest"] == sum(
        sum(version < row["last_weight_version"] for version in row["token_weight_versions"]) for row in rows
    )


def test_async_grpo_in_flight_without_recompute_keeps_the_old_kv_over_megafleets_wire(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path, local_ray: None
) -> None:
    kube_admin.create(refit_e2e.fleets(namespace), long_fleet())  # engine.kvCacheMode: persist (the default)
    master = master_config(recompute=False)
    models = step_models()
    training = [models[0]]
    generation = nemo.nemo_factory(
        "tiny",
        namespace,
        kubeconfig=kubeconfig,
        addressing="pod",
        ready_timeout_s=WAIT,
        weights=lambda: training[0].named_parameters(),
        master_config=master,
    )(config=master["policy"])
    try:
        assert generation.handle.refit_wire == "megafleet" and generation.prepare_for_generation()
        setup = generation.init_collective(refit_e2e.TRAINER_ADDRESS, refit_e2e.free_port(), 3, train_world_size=1)
        assert all(ray.get(setup))

        def refit(step: int) -> None:  # the adapter sends the policy's weights itself
            training[0] = models[step]
            assert all(ray.get(generation.update_weights_from_collective(refit_timeout_s=WAIT)))

        rows, running_after, collector = async_grpo(kube_admin, namespace, generation, master, refit)
        try:
            invalidations, waited = ray.get(collector.refit_record.remote())
            invalidated = ray.get(collector.invalidate_kv_cache.remote())
        finally:
            ray.kill(collector)
    finally:
        generation.shutdown()

    refits = refits_of(kube_admin, namespace)
    assert [(r["spec"]["version"], r["status"]["phase"]) for r in refits] == [(v, "Succeeded") for v in (1, 2, 3)]
    for refit_obj in refits:
        assert refit_obj["spec"]["inFlight"] == "keep" and "kvCacheMode" not in refit_obj["spec"]  # the fleet's
        in_flight = refit_obj["status"]["inFlight"]
        assert (in_flight["effective"], in_flight["kvCacheMode"]) == ("keep", "persist"), in_flight
    assert (invalidations, waited) == ([], 0)  # NeMo asks only with the recompute flag
    assert invalidated is False  # asked anyway: the old KV served on (NeMo would warn, truthfully)
    check_samples(rows, running_after, "persist")
