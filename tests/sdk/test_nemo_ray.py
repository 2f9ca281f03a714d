"""The NeMo RL adapter with Ray and a real engine process (the tiny Llama on CPU, on loopback).

NeMo RL hands ``policy_generation`` to its async trajectory collector, a Ray actor, by pickling it;
the actor runs every batch under ``asyncio.run`` in fresh threads. Here a local Ray instance
(``ray.init``, no cluster) runs such a collector (:mod:`helpers.nemo_collector`) over an adapter
with fixed frontends; the actor's copy reconnects on first use and its answers are the model's own
greedy tokens. On the driver, the methods NeMo RL passes to ``ray.get`` return real object refs.
The engine's length limit (128 tokens) is hit as vLLM's: truncated, not an error. Sampled
generation logprobs (T=0.7, top_k=5, top_p=0.9 in NeMo's generation config) are NeMo's processed
logprobs of the trainer's own forward pass.
(The actor seeing a driver's refit is proven against the real control plane in tests/e2e/test_sdk.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from helpers import engine_command, nemo_collector
from helpers.nemo_reference import nemo_processed_logprobs
from megafleet.sdk import nemo

HOST = "127.0.13.9"
LIMIT = 128  # the engine's MEGAFLEET_MAX_SEQUENCE_LENGTH
PROMPTS = [[1, 40 + i, 41 + 2 * i, 42] for i in range(6)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[engine_command.EngineProcess]:
    started = engine_command.EngineProcess(HOST, engine_command.token_file(tmp_path_factory.mktemp("agent")))
    try:
        started.wait_serving()
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with nemo_collector.local_ray():
        yield


def adapter(engine: engine_command.EngineProcess, **config: Any) -> nemo.MegafleetGeneration:
    return nemo.MegafleetGeneration(
        engine_command.MODEL,
        frontends=[engine.base_url],
        config={"max_new_tokens": 8, "temperature": 1.0, "_pad_token_id": 0, **config},
    )


@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_a_ray_actor_receives_the_adapter_and_generates_from_threads_under_asyncio_run(
    engine: engine_command.EngineProcess, local_ray: None
) -> None:
    reference = engine_command.Reference()
    generation = adapter(engine)
    assert not generation.connected
    collector: Any = ray.remote(nemo_collector.Collector).remote(generation)
    try:
        assert ray.get(collector.connected.remote()) is False  # the copy connects on first use
        results = ray.get(collector.collect.remote(PROMPTS, 3), timeout=120)
        assert ray.get(collector.connected.remote()) is True
        assert ray.get(collector.invalidate_kv_cache.remote()) is False  # kvCacheMode unknown here
    finally:
        ray.kill(collector)
        generation.shutdown()
    assert [result["tokens"] for result in results] == [reference.greedy(prompt, 8) for prompt in PROMPTS]
    assert {result["weight_version"] for result in results} == {0}


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_methods_nemo_rl_passes_to_ray_get_return_object_refs(
    engine: engine_command.EngineProcess, local_ray: None
) -> None:
    generation = adapter(engine)
    try:
        futures_inference = generation.init_collective("127.0.0.1", 29500, 3, train_world_size=1)
        futures_train = [ray.put(None)]
        assert all(isinstance(ref, ray.ObjectRef) for ref in futures_inference)
        results = ray.get(futures_train + futures_inference)
        assert all(result for result in results if result is not None) and results[1:] == [True]
        liveness = generation.shard_liveness_ref(0)
        assert isinstance(liveness, ray.ObjectRef) and ray.get(liveness) is True
    finally:
        generation.shutdown()


@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_asking_for_more_tokens_than_the_model_length_leaves_stops_there_as_truncated(
    engine: engine_command.EngineProcess,
) -> None:
    prompt = [1, 40, 41, 42, 43]
    generation = adapter(engine, max_new_tokens=LIMIT, ignore_eos=True)  # NeMo recipes' max_new_tokens
    try:
        out = generation.generate({"input_ids": torch.tensor([prompt]), "input_lengths": torch.tensor([5])})
        with pytest.raises(ValueError, match="the prompt at index 0 is 128 tokens"):
            generation.generate(
                {"input_ids": torch.ones((1, LIMIT), dtype=torch.long), "input_lengths": torch.tensor([LIMIT])}
            )
    finally:
        generation.shutdown()
    assert out["generation_lengths"].tolist() == [LIMIT - 5] and out["truncated"].tolist() == [True]
    assert out["unpadded_sequence_lengths"].tolist() == [LIMIT]


@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_a_batch_goes_to_the_engine_as_one_request_sync_and_async(engine: engine_command.EngineProcess) -> None:
    """Counted at the engine's own metrics: a fall-back to one request per prompt fails this."""
    reference = engine_command.Reference()
    width = max(len(prompt) for prompt in PROMPTS) + 2
    data = {
        "input_ids": torch.tensor([prompt + [0] * (width - len(prompt)) for prompt in PROMPTS]),
        "input_lengths": torch.tensor([len(prompt) for prompt in PROMPTS]),
    }
    generation = adapter(engine)

    async def stream() -> dict[int, list[int]]:
        got = {}
        async for index, single in generation.generate_async(data, greedy=True):
            length = len(PROMPTS[index])
            got[index] = single["output_ids"][0, length : length + int(single["generation_lengths"][0])].tolist()
        return got

    try:
        before = engine.requests()
        out = generation.generate(data, greedy=True)
        after_sync = engine.requests()
        streamed = asyncio.run(stream())
        after_async = engine.requests()
    finally:
        generation.shutdown()
    expected = [reference.greedy(prompt, 8) for prompt in PROMPTS]
    assert [
        out["output_ids"][i, len(prompt) : len(prompt) + int(out["generation_lengths"][i])].tolist()
        for i, prompt in enumerate(PROMPTS)
    ] == expected
    assert out["logprobs"][:, : len(PROMPTS[0])].abs().sum() == 0 and (out["logprobs"][0, 4:12] < 0).all()
    assert [streamed[i] for i in range(len(PROMPTS))] == expected
    assert (after_sync - before, after_async - after_sync) == (1, 1)


@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_sampled_logprobs_are_the_trainers_processed_logprobs_of_nemos_sampling_config(
    engine: engine_command.EngineProcess,
) -> None:
    """Sampled logprobs through the adapter: NeMo's ``temperature``/``top_k``/``top_p`` reach the
    engine and each returned logprob equals NeMo's trainer-side recomputation (a fresh forward pass
    over prompt + generated tokens, then :func:`nemo_processed_logprobs`) within 1e-4; raw
    logprobs, or the sampling knobs dropped on the way, would differ by more."""
    temperature, top_k, top_p = 0.7, 5, 0.9
    reference = engine_command.Reference()
    width = max(len(prompt) for prompt in PROMPTS)
    data = {
        "input_ids": torch.tensor([prompt + [0] * (width - len(prompt)) for prompt in PROMPTS]),
        "input_lengths": torch.tensor([len(prompt) for prompt in PROMPTS]),
    }
    generation = adapter(engine, max_new_tokens=16, ignore_eos=True, temperature=temperature, top_k=top_k, top_p=top_p)
    try:
        out = generation.generate(data)
    finally:
        generation.shutdown()
    worst, worst_raw, worst_t1 = 0.0, float("inf"), 0.0
    for i, prompt in enumerate(PROMPTS):
        length = int(out["generation_lengths"][i])
        assert length == 16
        tokens = out["output_ids"][i, len(prompt) : len(prompt) + length].tolist()
        served = out["logprobs"][i, len(prompt) : len(prompt) + length]
        with torch.no_grad():
            logits = reference.model(torch.tensor([prompt + tokens])).logits[0].float()
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + length]
        picked = torch.arange(length), torch.tensor(tokens)
        expected = nemo_processed_logprobs(rows, temperature=temperature, top_k=top_k, top_p=top_p)[picked]
        assert torch.isfinite(expected).all(), "every sampled token is inside NeMo's kept set"
        worst = max(worst, float((served - expected).abs().max()))
        worst_raw = min(worst_raw, float((served - torch.log_softmax(rows, dim=-1)[picked]).abs().max()))
        t1 = nemo_processed_logprobs(rows, temperature=1.0, top_k=top_k, top_p=top_p)[picked]
        worst_t1 = max(worst_t1, float((served - t1).abs().max()))
    assert worst < 1e-4, worst
    assert worst_raw > 1e-2 and worst_t1 > 1e-4, (worst_raw, worst_t1)  # the comparison can tell them apart
