"""Generation through the SDK against real engine processes on loopback (``python -m
megafleet_engine.cli``, the tiny Llama on CPU, each on its own 127.x address).

Three engines serve the same weights. The routable set comes from a fleet status (shards 0 and 1
Ready at the current version, shard 2 Stale, shard 3 Starting): each engine's own Prometheus
counters prove where requests went. Greedy answers must equal the tiny model's own greedy
generation, and the NeMo RL adapter's tensors must have NeMo RL's shapes and contents.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
import torch

from helpers import engine_command
from megafleet.api import v1alpha1
from megafleet.sdk import generation, nemo, routing

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

HOSTS = ("127.0.13.1", "127.0.13.2", "127.0.13.3")
NOWHERE = "http://127.0.13.4:9/v1"  # shard 3's frontend: nothing listens there
MAX_TOKENS = 8
PROMPTS = [[1, 40 + i, 41 + 2 * i, 42, 43 + i % 3] for i in range(16)]
GREEDY = generation.Sampling(max_tokens=MAX_TOKENS, temperature=0)
FULL_LENGTH = generation.Sampling(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[engine_command.EngineProcess]]:
    token = engine_command.token_file(tmp_path_factory.mktemp("agent"))
    started = [engine_command.EngineProcess(host, token) for host in HOSTS]
    try:
        for engine in started:
            engine.wait_serving()
        yield started
    finally:
        for engine in started:
            engine.close()


@pytest.fixture(scope="module")
def reference() -> engine_command.Reference:
    return engine_command.Reference()


def fleet_status(engines: list[engine_command.EngineProcess]) -> v1alpha1.MegatronGenerationStatus:
    return v1alpha1.MegatronGenerationStatus.model_validate(
        {
            "shards": [
                {"index": 0, "phase": "Ready", "weightVersion": 0},
                {"index": 1, "phase": "Ready", "weightVersion": 0},
                {"index": 2, "phase": "Stale", "weightVersion": 0, "lastError": "serves version 0, the fleet is at 1"},
                {"index": 3, "phase": "Starting"},
            ],
            "refit": {"currentVersion": 0},
        }
    )


def routed(engines: list[engine_command.EngineProcess]) -> routing.Router:
    urls = {index: engine.base_url for index, engine in enumerate(engines)} | {3: NOWHERE}
    return routing.Router(routing.select(urls, routing.routable(fleet_status(engines))))


def counts(engines: list[engine_command.EngineProcess], endpoint: str = "/v1/completions") -> list[int]:
    return [engine.requests(endpoint) for engine in engines]


def test_a_batch_spreads_over_every_ready_frontend_and_never_reaches_stale_or_starting_ones(
    engines: list[engine_command.EngineProcess], reference: engine_command.Reference
) -> None:
    router = routed(engines)
    assert [frontend.shard for frontend in router.frontends] == [0, 1]
    before = counts(engines)

    async def run() -> list[generation.Answer]:
        async with generation.Generator(router, model=engine_command.MODEL) as generator:
            return await generator.complete_batch(PROMPTS, FULL_LENGTH)

    answers = asyncio.run(run())

    served = [after - then for after, then in zip(counts(engines), before, strict=True)]
    # one batched request (a list of prompts) per ready frontend; none to the stale shard's
    assert served == [1, 1, 0], served
    assert len({answer.shard for answer in answers}) == 2
    assert NOWHERE not in router.sent
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer.token_ids == reference.greedy(prompt, MAX_TOKENS, ignore_eos=True)
        assert answer.weight_version == 0 and answer.shard in (0, 1)
        assert answer.weight_version_spans == (generation.VersionSpan(0, 0),) and answer.last_weight_version == 0
        assert answer.prompt_token_ids == prompt
        assert answer.logprobs is not None and len(answer.logprobs) == len(answer.token_ids)
        assert all(math.isfinite(value) and value <= 0 for value in answer.logprobs)
        assert len(answer.token_ids) == MAX_TOKENS and answer.finish_reason == "length"


def test_a_chat_batch_is_one_batched_request_per_ready_frontend_answering_the_templated_prompts(
    engines: list[engine_command.EngineProcess], reference: engine_command.Reference
) -> None:
    router = routed(engines)
    conversations = [[{"role": "user", "content": f"count to {n}"}] for n in range(8)]
    before_batch, before_single = counts(engines, "/v1/chat/completions/batch"), counts(engines, "/v1/chat/completions")

    async def run() -> list[generation.Answer]:
        async with generation.Generator(router, model=engine_command.MODEL) as generator:
            return await generator.chat_batch(conversations, GREEDY)

    answers = asyncio.run(run())

    batched = [
        after - then for after, then in zip(counts(engines, "/v1/chat/completions/batch"), before_batch, strict=True)
    ]
    single = [after - then for after, then in zip(counts(engines, "/v1/chat/completions"), before_single, strict=True)]
    # one batched request (a list of conversations) per ready frontend, none per conversation
    assert batched == [1, 1, 0] and single == [0, 0, 0], (batched, single)
    for conversation, answer in zip(conversations, answers, strict=True):
        templated = reference.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert answer.prompt_token_ids == list(templated)  # in order: each answer is its own conversation's
        assert answer.token_ids == reference.greedy(answer.prompt_token_ids, MAX_TOKENS)
        assert answer.logprobs is not None and len(answer.logprobs) == len(answer.token_ids)
        assert answer.weight_version == 0 and answer.shard in (0, 1)
        assert answer.weight_version_spans == (generation.VersionSpan(0, 0),)


def test_a_frontend_that_cannot_be_reached_is_skipped(engines: list[engine_command.EngineProcess]) -> None:
    router = routing.Router([routing.Frontend(0, NOWHERE, 0), routing.Frontend(1, engines[0].base_url, 0)])

    async def run() -> list[generation.Answer]:
        async with generation.Generator(router, model=engine_command.MODEL) as generator:
            return await generator.complete_batch(PROMPTS[:4], GREEDY)

    answers = asyncio.run(run())

    assert {answer.shard for answer in answers} == {1}
    assert router.sent[NOWHERE] >= 1  # it was tried, failed over, and every answer still came back


def test_the_nemo_adapter_returns_nemo_rls_tensors(
    engines: list[engine_command.EngineProcess], reference: engine_command.Reference
) -> None:
    prompts = [[1, 40, 41, 42, 43], [1, 50], [1, 60, 61]]
    width = max(len(prompt) for prompt in prompts)
    pad = 0
    input_ids = torch.tensor([prompt + [pad] * (width - len(prompt)) for prompt in prompts])
    input_lengths = torch.tensor([len(prompt) for prompt in prompts])
    adapter = nemo.MegafleetGeneration(
        "tiny",
        frontends=[engines[0].base_url, engines[1].base_url],
        config={"max_new_tokens": MAX_TOKENS, "temperature": 1.0, "_pad_token_id": pad},
    )
    try:
        assert adapter.prepare_for_generation()
        out = adapter.generate({"input_ids": input_ids, "input_lengths": input_lengths}, greedy=True)

        async def collect() -> dict[int, dict[str, torch.Tensor]]:
            data = {"input_ids": input_ids, "input_lengths": input_lengths}
            return {index: single async for index, single in adapter.generate_async(data, greedy=True)}

        singles = asyncio.run(collect())
        assert adapter.finish_generation()
    finally:
        assert adapter.shutdown() and adapter.shutdown()  # repeated calls are safe

    expected = [reference.greedy(prompt, MAX_TOKENS) for prompt in prompts]
    longest = max(len(tokens) for tokens in expected)
    assert out["output_ids"].shape == (3, width + longest) and out["logprobs"].shape == (3, width + longest)
    assert out["output_ids"].dtype == input_ids.dtype and out["logprobs"].dtype == torch.float32
    assert out["generation_lengths"].tolist() == [len(tokens) for tokens in expected]
    assert out["unpadded_sequence_lengths"].tolist() == [
        len(p) + len(t) for p, t in zip(prompts, expected, strict=True)
    ]
    assert out["weight_versions"].tolist() == [0, 0, 0]
    assert out["last_weight_versions"].tolist() == [0, 0, 0]
    assert out["token_weight_versions"].shape == out["logprobs"].shape
    for i, (prompt, tokens) in enumerate(zip(prompts, expected, strict=True)):
        end = len(prompt) + len(tokens)
        assert out["output_ids"][i, :end].tolist() == prompt + tokens
        versions = out["token_weight_versions"][i].tolist()
        assert versions == [-1] * len(prompt) + [0] * len(tokens) + [-1] * (len(versions) - end)
        assert (out["output_ids"][i, end:] == pad).all()
        assert (out["logprobs"][i, : len(prompt)] == 0).all() and (out["logprobs"][i, end:] == 0).all()
        assert (out["logprobs"][i, len(prompt) : end] < 0).all()
    assert sorted(singles) == [0, 1, 2]
    for i, single in singles.items():
        end = len(prompts[i]) + len(expected[i])
        assert single["output_ids"].shape[0] == 1
        assert single["output_ids"][0, :end].tolist() == out["output_ids"][i, :end].tolist()
        assert torch.allclose(single["logprobs"][0, :end], out["logprobs"][i, :end])
