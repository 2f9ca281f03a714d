"""The transformers backend and the engine's batching scheduler, on the tiny model (CPU)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from megafleet_engine import engine
from megafleet_engine.backends import base, load_backend, transformers_backend
from megafleet_engine.models import tiny


@pytest.fixture(scope="module")
def backend() -> transformers_backend.TransformersBackend:
    loaded = load_backend("transformers", "tiny://llama", name="tiny", max_sequence_length=256)
    assert isinstance(loaded, transformers_backend.TransformersBackend)
    return loaded


def run(backend: base.Backend, requests: list[base.SequenceRequest]) -> dict[str, list[base.TokenStep]]:
    steps: dict[str, list[base.TokenStep]] = {request.request_id: [] for request in requests}
    for batch in backend.generate(requests):
        for step in batch:
            steps[step.request_id].append(step)
    return steps


def greedy(request_id: str, prompt: list[int], max_tokens: int, **extra: object) -> base.SequenceRequest:
    return base.SequenceRequest(
        request_id, tuple(prompt), base.SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)
    )  # type: ignore[arg-type]


PROMPTS = ["hello", "the quick brown fox jumps over", "a", "RL needs token log-probabilities"]


def test_batched_greedy_equals_the_models_own_greedy_generation(
    backend: transformers_backend.TransformersBackend,
) -> None:
    prompts = [backend.tokenizer.encode(text) for text in PROMPTS]
    requests = [greedy(str(i), prompt, 16, ignore_eos=True) for i, prompt in enumerate(prompts)]

    produced = run(backend, requests)

    for request, prompt in zip(requests, prompts, strict=True):
        reference = backend.model.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert [step.token_id for step in produced[request.request_id]] == reference
        assert produced[request.request_id][-1].finish_reason == "length"


def test_greedy_is_deterministic_and_top_k_one_is_greedy(backend: transformers_backend.TransformersBackend) -> None:
    prompt = backend.tokenizer.encode("deterministic")
    first = run(backend, [greedy("a", prompt, 10)])["a"]
    second = run(backend, [greedy("a", prompt, 10)])["a"]
    top1 = run(backend, [base.SequenceRequest("b", tuple(prompt), base.SamplingParams(max_tokens=10, top_k=1))])["b"]
    assert [s.token_id for s in first] == [s.token_id for s in second] == [s.token_id for s in top1]


def test_seeded_sampling_reproduces_and_seeds_differ(backend: transformers_backend.TransformersBackend) -> None:
    prompt = tuple(backend.tokenizer.encode("sample me"))

    def sample(seed: int) -> list[int]:
        params = base.SamplingParams(max_tokens=24, temperature=1.5, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        return [s.token_id for s in run(backend, [base.SequenceRequest("s", prompt, params)])["s"]]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs_are_log_softmax_of_the_model(backend: transformers_backend.TransformersBackend) -> None:
    prompt = backend.tokenizer.encode("logprobs")
    steps = run(backend, [greedy("l", prompt, 3, logprobs=2)])["l"]
    with torch.no_grad():
        logits = backend.model(torch.tensor([prompt])).logits[0, -1].float()
    expected = torch.log_softmax(logits, -1)
    assert steps[0].logprob == pytest.approx(float(expected[steps[0].token_id]), abs=1e-4)
    assert len(steps[0].top_logprobs) == 2
    assert steps[0].top_logprobs[0][0] == steps[0].token_id  # greedy picks the most likely token


def test_stop_token_and_eos_end_a_sequence(backend: transformers_backend.TransformersBackend) -> None:
    prompt = backend.tokenizer.encode("stop")
    free = [s.token_id for s in run(backend, [greedy("f", prompt, 8, ignore_eos=True)])["f"]]
    stopped = run(backend, [greedy("s", prompt, 8, stop_token_ids=(free[2],))])["s"]
    assert [s.token_id for s in stopped] == free[: free.index(free[2]) + 1]
    assert stopped[-1].finish_reason == "stop"


def test_checkpoint_load_writes_in_place(backend: transformers_backend.TransformersBackend) -> None:
    deferred = load_backend("transformers", "tiny://llama", name="t", max_sequence_length=64, load_weights=False)
    pointers = {name: tensor.data_ptr() for name, tensor in deferred.parameters().items()}
    assert all(float(t.abs().sum()) == 0.0 for t in deferred.parameters().values())

    deferred.load_checkpoint("tiny://llama")

    reference = tiny.reference_weights("tiny://llama")
    for name, tensor in deferred.parameters().items():
        assert tensor.data_ptr() == pointers[name]
        assert torch.equal(tensor, reference[name])


def test_engine_batches_requests_that_arrive_together(backend: transformers_backend.TransformersBackend) -> None:
    core = engine.Engine(backend, max_batch_size=16)
    release = threading.Event()
    blocker = core.run_exclusive(release.wait)  # hold the backend thread so requests pile up

    async def scenario() -> list[list[int]]:
        blocked = asyncio.ensure_future(blocker)
        prompts = [backend.tokenizer.encode(text) for text in PROMPTS]

        async def one(i: int) -> list[int]:
            return [step.token_id async for step in core.submit(greedy(str(i), prompts[i], 6, ignore_eos=True))]

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        while core.queue_depth < len(prompts):
            await asyncio.sleep(0)  # let every submit reach the queue
        release.set()
        await blocked
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(scenario())
    finally:
        core.close()
    assert max(core.batch_sizes) == len(PROMPTS)
    expected = run(
        backend, [greedy(str(i), backend.tokenizer.encode(t), 6, ignore_eos=True) for i, t in enumerate(PROMPTS)]
    )
    assert results == [[s.token_id for s in expected[str(i)]] for i in range(len(PROMPTS))]


def test_suspended_engine_refuses_requests_and_resume_reopens(
    backend: transformers_backend.TransformersBackend,
) -> None:
    core = engine.Engine(backend)

    async def scenario() -> None:
        await core.suspend("drain")
        with pytest.raises(engine.NotServing) as refused:
            async for _ in core.submit(greedy("x", [1, 2], 2)):
                pass
        assert refused.value.state == "suspended"
        core.resume(weight_version=3)
        tokens = [step async for step in core.submit(greedy("y", [1, 2], 2))]
        assert len(tokens) == 2 and core.weight_version == 3

    try:
        asyncio.run(scenario())
    finally:
        core.close()


def test_deferred_engine_is_loading_until_weights_arrive(backend: transformers_backend.TransformersBackend) -> None:
    core = engine.Engine(backend, weight_version=None)
    try:
        assert core.state == "loading"
        with pytest.raises(engine.EngineError):
            core.resume()
        core.resume(weight_version=0)
        assert core.state == "ready"
    finally:
        core.close()
