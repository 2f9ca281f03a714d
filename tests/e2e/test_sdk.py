"""The RL-job SDK against the real control plane, the operator and engine pods run by the local runner.

A NeMo-RL-style loop through :class:`megafleet.sdk.nemo.MegafleetGeneration`, in NeMo RL's call
orders (GRPO's setup, then one step each in vLLM's refit order, MegatronWeightSynchronizer's and
async GRPO's): wait until the fleet is Ready, generate (spread over both shards, the engines' own
greedy output at version 0), refit through Refit objects with the trainer's changed weights sent by
the SDK's WeightSender, and generate after each refit with sync rollouts (``generate``), async
rollouts (``generate_async`` under ``asyncio.run``) and, as async GRPO does, from a trajectory
collector that is a Ray actor holding a pickled copy of the adapter (local ``ray.init``) and sees the
driver's refits; then refit from a checkpoint. Every step's answers carry the next version and the
greedy tokens of the weights sent. The fleet client's errors name what blocks a fleet.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from helpers import engine_command, nemo_collector
from megafleet.sdk import errors, fleet, nemo
from megafleet_dev import kube
from megafleet_protocol import ports

ROOT = Path(__file__).resolve().parents[2]
WAIT = 120
TRAINER_ADDRESS = "127.0.9.3"
MAX_TOKENS = 8
PROMPTS = [[1, 50], [1, 60, 61], [1, 41, 43, 42, 44], [1, 70, 71, 72], [1, 80], [1, 90, 91]]


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def tiny_fleet(**spec: Any) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"].update(spec)
    return manifest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((TRAINER_ADDRESS, 0))
        return int(probe.getsockname()[1])


def batch() -> dict[str, torch.Tensor]:
    width = max(len(prompt) for prompt in PROMPTS)
    return {
        "input_ids": torch.tensor([prompt + [0] * (width - len(prompt)) for prompt in PROMPTS]),
        "input_lengths": torch.tensor([len(prompt) for prompt in PROMPTS]),
    }


def generated(out: dict[str, torch.Tensor]) -> list[list[int]]:
    return [
        out["output_ids"][i, len(prompt) : len(prompt) + int(out["generation_lengths"][i])].tolist()
        for i, prompt in enumerate(PROMPTS)
    ]


def completions_served(kube_admin: kube.Kube, namespace: str, pods: list[str]) -> list[int]:
    """``/v1/completions`` requests each pod's engine counted (its Prometheus metrics on the pod IP)."""
    counts = []
    for pod in pods:
        found = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
        assert found is not None
        text = httpx.get(f"http://{found['status']['podIP']}:{ports.METRICS_PORT}/metrics", timeout=30).text
        counts.append(
            int(
                sum(
                    sample.value
                    for family in text_string_to_metric_families(text)
                    for sample in family.samples
                    if sample.name == "megafleet_requests_total" and sample.labels.get("endpoint") == "/v1/completions"
                )
            )
        )
    return counts


@pytest.fixture
def local_ray() -> Iterator[None]:
    with nemo_collector.local_ray():
        yield


def async_rollout(generation: nemo.MegafleetGeneration) -> dict[str, torch.Tensor]:
    """NeMo RL's async rollout on the driver: one-row batches through ``generate_async`` under
    ``asyncio.run``, gathered back in sample order."""

    async def run() -> list[dict[str, torch.Tensor]]:
        async def one(prompt: list[int]) -> dict[str, torch.Tensor]:
            row = {"input_ids": torch.tensor([prompt]), "input_lengths": torch.tensor([len(prompt)])}
            singles: list[dict[str, torch.Tensor]] = [
                single async for _, single in generation.generate_async(row, greedy=True)
            ]
            assert len(singles) == 1
            return singles[0]

        return list(await asyncio.gather(*(one(prompt) for prompt in PROMPTS)))

    rows = asyncio.run(run())
    return {
        "output_ids": torch.nn.utils.rnn.pad_sequence([row["output_ids"][0] for row in rows], batch_first=True),
        "generation_lengths": torch.cat([row["generation_lengths"] for row in rows]),
        "weight_versions": torch.cat([row["weight_versions"] for row in rows]),
    }


def test_a_nemo_style_loop_generates_refits_and_generates_the_trainers_tokens(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path, tmp_path: Path, local_ray: None
) -> None:
    kube_admin.create(fleets(namespace), tiny_fleet())
    engines = engine_command.Reference()  # the fleet's own weights (tiny://llama)
    trainers = [engine_command.Reference("tiny://llama?seed=7"), engine_command.Reference("tiny://llama?seed=13")]
    training = [trainers[0]]  # the model the trainer holds now

    generation = nemo.MegafleetGeneration(
        "tiny",
        namespace,
        kubeconfig=kubeconfig,
        addressing="pod",  # the local control plane's ClusterIPs are data, pod IPs are loopback
        config={"max_new_tokens": MAX_TOKENS, "temperature": 1.0, "_pad_token_id": 0},
        weights=lambda: training[0].model.named_parameters(),
        ready_timeout_s=WAIT,
    )
    pods = ["tiny-s0-p0", "tiny-s1-p0"]

    def greedy(reference: engine_command.Reference) -> list[list[int]]:
        return [reference.greedy(prompt, MAX_TOKENS) for prompt in PROMPTS]

    try:
        # GRPO's setup: the generation backend wakes, the collective is set up once
        assert generation.prepare_for_generation()
        assert generation.weight_version == 0
        assert generation.cfg["backend"] == "megatron"
        before = completions_served(kube_admin, namespace, pods)
        first = generation.generate(batch(), greedy=True)
        served = [
            after - then for after, then in zip(completions_served(kube_admin, namespace, pods), before, strict=True)
        ]
        assert generated(first) == greedy(engines)
        assert first["weight_versions"].tolist() == [0] * len(PROMPTS)
        assert served == [1, 1], served  # one batched request per frontend, not one per prompt
        futures_train = [ray.put(None)]  # the policy's own init_collective futures
        setup = ray.get(futures_train + generation.init_collective(TRAINER_ADDRESS, free_port(), 3, train_world_size=1))
        assert all(result for result in setup if result is not None)
        generation.prepare_refit_info({name: None for name, _ in trainers[0].model.named_parameters()})

        # step 1, vLLM's order: update_weights_from_collective alone; a sync rollout (generate)
        results = ray.get(generation.update_weights_from_collective(refit_timeout_s=WAIT))
        assert all(results)
        generation.clear_logger_metrics()
        second = generation.generate(batch(), greedy=True)
        assert generation.finish_generation()
        assert generation.get_logger_metrics()["megafleet/requests"] == len(PROMPTS)
        assert generation.weight_version == 1
        assert second["weight_versions"].tolist() == [1] * len(PROMPTS)
        assert generated(second) == greedy(trainers[0]) != generated(first)

        # step 2, MegatronWeightSynchronizer's order; an async rollout (generate_async under asyncio.run)
        training[0] = trainers[1]
        generation.suspend_for_refit()
        generation.prepare_for_generation(tags=["weights"])
        assert all(ray.get(generation.update_weights_from_collective(refit_timeout_s=WAIT)))
        generation.prepare_for_generation(tags=["kv_cache"])
        generation.resume_after_refit()
        third = async_rollout(generation)
        assert third["weight_versions"].tolist() == [2] * len(PROMPTS)
        assert generated(third) == greedy(trainers[1])

        # step 3, async GRPO: the collector actor holds a pickled copy; the driver refits between its batches
        collector: Any = ray.remote(nemo_collector.Collector).remote(generation)
        try:
            seen = ray.get(collector.collect.remote(PROMPTS, 2), timeout=WAIT)
            assert [row["weight_version"] for row in seen] == [2] * len(PROMPTS)
            assert [row["tokens"] for row in seen] == greedy(trainers[1])
            training[0] = trainers[0]
            assert all(ray.get(generation.update_weights_from_collective(refit_timeout_s=WAIT)))
            generation.set_rollout_weight_version(3)  # the trainer's weight_version += 1, told after the refit
            seen = ray.get(collector.collect.remote(PROMPTS, 2), timeout=WAIT)
            assert [row["weight_version"] for row in seen] == [3] * len(PROMPTS)
            assert [row["tokens"] for row in seen] == greedy(trainers[0])
            # the copy reads the last Refit's status: it drained (no async flags given), so no KV
            # computed with the old weights serves after it
            assert ray.get(collector.invalidate_kv_cache.remote()) is True
        finally:
            ray.kill(collector)

        saved = engine_command.Reference("tiny://llama?seed=11")
        weights = {name: tensor.detach().contiguous() for name, tensor in saved.model.named_parameters()}
        save_file(weights, tmp_path / "model.safetensors")
        assert generation.update_weights_from_checkpoint(str(tmp_path), refit_timeout_s=WAIT)
        fourth = generation.generate(batch(), greedy=True)

        assert fourth["weight_versions"].tolist() == [4] * len(PROMPTS)
        assert generated(fourth) == greedy(saved)
    finally:
        generation.shutdown()
    refits = kube_admin.list(f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/refits")["items"]
    assert sorted((r["spec"]["version"], r["status"]["phase"]) for r in refits) == [
        (version, "Succeeded") for version in (1, 2, 3, 4)
    ]
    assert [r["spec"]["source"] for r in sorted(refits, key=lambda r: r["spec"]["version"])][3] == {
        "checkpoint": {"path": str(tmp_path)}
    }


def test_the_fleet_client_names_what_keeps_a_fleet_from_ready_and_why_a_refit_failed(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path
) -> None:
    kube_admin.create(
        fleets(namespace),
        {**tiny_fleet(frontend={"apiKeySecret": {"name": "missing"}}), "metadata": {"name": "keyless"}},
    )
    kube_admin.create(
        fleets(namespace),
        {
            **tiny_fleet(replicas=1, placement={"nodeSelector": {"example.com/none": "x"}}),
            "metadata": {"name": "nowhere"},
        },
    )
    kube_admin.create(fleets(namespace), {**tiny_fleet(replicas=1), "metadata": {"name": "one"}})
    kube_admin.wait(
        f"{fleets(namespace)}/nowhere",
        lambda o: (kube.condition(o, "Ready") or {}).get("reason") == "ShardsNotReady",
        timeout=WAIT,
        what="the unplaceable fleet's Ready condition",
    )

    async def run() -> None:
        async with fleet.Fleet("absent", namespace, kubeconfig=kubeconfig, addressing="pod") as absent:
            with pytest.raises(errors.FleetNotFound, match="absent does not exist"):
                await absent.wait_ready(timeout=WAIT)
        async with fleet.Fleet("keyless", namespace, kubeconfig=kubeconfig, addressing="pod") as keyless:
            with pytest.raises(errors.FleetNotReady, match="InvalidSpec") as invalid:
                await keyless.wait_ready(timeout=WAIT)
            assert invalid.value.reason == "InvalidSpec" and "missing" in invalid.value.message
        async with fleet.Fleet("nowhere", namespace, kubeconfig=kubeconfig, addressing="pod") as nowhere:
            with pytest.raises(errors.FleetNotReady, match="still not Ready after 2 s") as late:
                await nowhere.wait_ready(timeout=2)
            assert late.value.reason == "ShardsNotReady" and "shard 0: Pending" in str(late.value)
        async with fleet.Fleet("one", namespace, kubeconfig=kubeconfig, addressing="pod") as one:
            ready = await one.wait_ready(timeout=WAIT)
            assert ready.ready and [f.shard for f in one.router.frontends] == [0]
            with pytest.raises(errors.RefitFailed, match="attempt 2 failed") as failed:
                await one.refit(1, checkpoint="/nonexistent/megafleet-checkpoint", timeout=WAIT)
            assert failed.value.status is not None and failed.value.status.phase == "Failed"
            assert failed.value.status.attempts == 2

    asyncio.run(run())
