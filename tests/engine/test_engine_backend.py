"""The transformers backend and the engine's batching scheduler, on the tiny model (CPU): batching,
the scheduler's invariants (cancel, drain, abort, weight writes between batches, one weight version
per response) and, on a backend double, continuous batching (admission between decode steps)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any

import pytest
import torch

from megafleet_engine import engine
from megafleet_engine.backends import base, load_backend, transformers_backend
from megafleet_engine.models import tiny
from megafleet_protocol import vocabulary


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


def greedy(request_id: str, prompt: list[int], max_tokens: int, **extra: Any) -> base.SequenceRequest:
    return base.SequenceRequest(
        request_id, tuple(prompt), base.SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)
    )


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
        assert core.state == "ready"  # type: ignore[comparison-overlap]  # resume() changed it
    finally:
        core.close()


# -- the scheduler's invariants on the transformers backend (no admission: batch after batch) -------


def collect(core: engine.Engine, request: base.SequenceRequest) -> asyncio.Future[list[int]]:
    """Submit ``request`` and gather its tokens (an error raised by the engine is the result)."""

    async def run() -> list[int]:
        return [step.token_id async for step in core.submit(request)]

    return asyncio.ensure_future(run())


async def first_token(
    core: engine.Engine, request: base.SequenceRequest
) -> tuple[AsyncGenerator[base.TokenStep, None], int]:
    stream = core.submit(request)
    return stream, (await anext(stream)).token_id


def perturbed(backend: transformers_backend.TransformersBackend) -> dict[str, torch.Tensor]:
    return {name: tensor + 0.05 * torch.randn_like(tensor) for name, tensor in backend.parameters().items()}


def test_transformers_backend_stops_sequences_the_scheduler_closed(
    backend: transformers_backend.TransformersBackend,
) -> None:
    prompts = [backend.tokenizer.encode(text) for text in PROMPTS[:2]]
    requests = [greedy("a", prompts[0], 12, ignore_eos=True), greedy("b", prompts[1], 12, ignore_eos=True)]
    asked: list[int] = []

    def admit(capacity: int) -> base.Admission:
        asked.append(capacity)
        return base.Admission(leave={"a"} if len(asked) >= 2 else set())

    produced: dict[str, list[int]] = {"a": [], "b": []}
    for steps in backend.generate(requests, admit=admit):
        for step in steps:
            produced[step.request_id].append(step.token_id)
    alone = run(backend, requests[1:])["b"]
    assert set(asked) == {0}, "a backend without admission must never ask for sequences"
    assert len(produced["a"]) == 2
    assert produced["b"] == [step.token_id for step in alone]


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_cancelled_request_stops_and_the_others_go_on(backend: transformers_backend.TransformersBackend) -> None:
    core = engine.Engine(backend)
    prompts = [backend.tokenizer.encode(text) for text in PROMPTS[:2]]
    steps_by_id: dict[str, int] = {}
    original = backend.generate

    def counting(batch: Any, admit: Any = None) -> Any:
        for steps in original(batch, admit):
            for step in steps:
                steps_by_id[step.request_id] = steps_by_id.get(step.request_id, 0) + 1
            yield steps

    async def scenario() -> list[int]:
        other = collect(core, greedy("other", prompts[1], 30, ignore_eos=True))
        stream, _ = await first_token(core, greedy("left", prompts[0], 200, ignore_eos=True))
        await stream.aclose()  # the client is gone
        return await other

    backend.generate = counting  # type: ignore[method-assign]
    try:
        other_tokens = asyncio.run(scenario())
    finally:
        del backend.generate
        core.close()
    expected = run(backend, [greedy("other", prompts[1], 30, ignore_eos=True)])["other"]
    assert other_tokens == [step.token_id for step in expected]
    assert steps_by_id["left"] <= 32, "the engine kept generating for a client that left"
    assert core.queue_depth == 0


def test_weight_writes_wait_for_the_batch_and_never_overlap_generation(
    backend: transformers_backend.TransformersBackend,
) -> None:
    core = engine.Engine(backend)
    prompt = backend.tokenizer.encode("overlap")
    generating = threading.Event()
    original = backend.generate

    def flagged(batch: Any, admit: Any = None) -> Any:
        generating.set()
        try:
            yield from original(batch, admit)
        finally:
            generating.clear()

    def write() -> bool:
        return generating.is_set()

    async def scenario() -> tuple[list[int], bool]:
        stream, first = await first_token(core, greedy("g", prompt, 40, ignore_eos=True))
        overlapped = await core.run_exclusive(write)  # queued while the batch runs
        return [first] + [step.token_id async for step in stream], overlapped

    backend.generate = flagged  # type: ignore[method-assign]
    try:
        tokens, overlapped = asyncio.run(scenario())
    finally:
        del backend.generate
        core.close()
    assert not overlapped
    assert len(tokens) == 40


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_refit_between_suspend_and_resume_never_mixes_weight_versions(
    backend: transformers_backend.TransformersBackend,
) -> None:
    """Requests in flight at the suspend finish on the old weights (drain); requests after the
    resume run on the new ones; no response mixes the two."""
    core = engine.Engine(backend, max_batch_size=2)
    prompts = [backend.tokenizer.encode(text) for text in PROMPTS[:3]]
    requests = [greedy(str(i), prompt, 24, ignore_eos=True) for i, prompt in enumerate(prompts)]
    saved = {name: tensor.clone() for name, tensor in backend.parameters().items()}
    new_weights = perturbed(backend)
    old = {key: [s.token_id for s in steps] for key, steps in run(backend, requests).items()}

    def write_new() -> None:
        for name, tensor in backend.parameters().items():
            tensor.copy_(new_weights[name])

    async def scenario() -> tuple[list[list[int]], list[int]]:
        running = [collect(core, request) for request in requests]  # batch of 2, the third queued
        while core.batches == 0:
            await asyncio.sleep(0.001)
        await core.suspend("drain")
        assert core.queue_depth == 0 and all(task.done() for task in running)
        with pytest.raises(engine.NotServing):
            await collect(core, requests[0])
        await core.run_exclusive(write_new)
        core.resume(weight_version=1)
        after = await collect(core, requests[0])
        return [task.result() for task in running], after

    try:
        before, after = asyncio.run(scenario())
        new = {key: [s.token_id for s in steps] for key, steps in run(backend, requests[:1]).items()}
    finally:
        with torch.no_grad():
            for name, tensor in backend.parameters().items():
                tensor.copy_(saved[name])
        core.close()
    assert before == [old[str(i)] for i in range(3)]
    assert after == new["0"] != old["0"]
    assert core.weight_version == 1


def test_suspend_abort_ends_running_and_queued_requests(backend: transformers_backend.TransformersBackend) -> None:
    core = engine.Engine(backend, max_batch_size=1)
    prompt = backend.tokenizer.encode("abort")

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        stream, _ = await first_token(core, greedy("running", prompt, 200, ignore_eos=True))
        queued = collect(core, greedy("queued", prompt, 200, ignore_eos=True))
        await asyncio.sleep(0)
        await core.suspend("abort", timeout_seconds=30)
        with pytest.raises(engine.Aborted) as running_error:
            async for _ in stream:
                pass
        with pytest.raises(engine.Aborted) as queued_error:
            await queued
        return running_error.value, queued_error.value

    try:
        errors = asyncio.run(scenario())
    finally:
        core.close()
    assert all(isinstance(error, engine.Aborted) for error in errors)
    assert core.batches == 1, "the queued request must never have started"
    assert core.queue_depth == 0


# -- the admission path of the scheduler, on a backend double ------------------------------------


class SteppedBackend(base.InPlaceOnly):
    """A backend double with continuous batching: each sequence yields ``100 + n`` at its n-th step
    and finishes after ``max_tokens``; every step waits for the test's go-ahead and then admits (so
    what was queued before the go-ahead joins that step), and everything the scheduler does to it is
    logged."""

    supports_admission = True
    kv_cache_mode: vocabulary.KvCacheMode = "offload"
    tokenizer = None
    follows = False
    spans_ranks = False

    def __init__(self) -> None:
        self.info = base.ModelInfo(name="double", max_sequence_length=512, vocab_size=1000, eos_token_id=None)
        self.log: list[tuple[str, object]] = []
        self.go = threading.Semaphore(0)
        self.admitted = threading.Semaphore(0)  # released once a step has admitted
        self.waiting = threading.Event()
        self.generating = False

    def generate(self, batch: Any, admit: base.Admit | None = None) -> Any:
        running = {request.request_id: [request, 0] for request in batch}
        self.log.append(("batch", sorted(running)))
        self.generating = True
        try:
            while running:
                self.waiting.set()  # each step waits for the test's go-ahead, then admits, then runs
                self.go.acquire()
                self.waiting.clear()
                if admit is not None:
                    admission = admit(8 - len(running))
                    for request in admission.join:
                        running[request.request_id] = [request, 0]
                    if admission.join:
                        self.log.append(("join", sorted(request.request_id for request in admission.join)))
                    if admission.leave:
                        self.log.append(("leave", sorted(admission.leave)))
                    for key in admission.leave:
                        running.pop(key, None)
                self.admitted.release()
                if not running:
                    return
                steps = []
                for key, state in list(running.items()):
                    request, count = state
                    state[1] = count = count + 1
                    done = count >= request.params.max_tokens
                    steps.append(base.TokenStep(key, 100 + count, None, finish_reason="length" if done else None))
                    if done:
                        del running[key]
                yield steps
        finally:
            self.generating = False
            self.log.append(("end", None))

    def parameters(self) -> dict[str, torch.Tensor]:
        return {}

    def load_checkpoint(self, source: str, *, staged: bool = False) -> None:
        pass

    def begin_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        self.log.append(("begin", kv_cache_mode))

    def finish_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        self.log.append(("finish", kv_cache_mode))

    def shard_map(self) -> None:
        return None

    def settle_weight_update(self, version: int, *, ok: bool, timeout_seconds: float) -> bool:
        return ok

    def serve_followers(self) -> None:
        raise AssertionError("a single-process double has no followers")

    def close(self) -> None:
        pass


def plain(request_id: str, max_tokens: int) -> base.SequenceRequest:
    return base.SequenceRequest(request_id, (1, 2, 3), base.SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def step_when_ready(double: SteppedBackend, steps: int = 1) -> None:
    """Let the double run ``steps`` steps, each once it waits for the go-ahead, and return once the
    last one has admitted (what is queued after this returns joins a later step)."""
    for _ in range(steps):
        assert await asyncio.to_thread(double.waiting.wait, 10)
        double.waiting.clear()
        double.go.release()
        assert await asyncio.to_thread(double.admitted.acquire, True, 10)


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(5000):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition not reached in 10 s")


def test_requests_join_the_running_batch_between_steps() -> None:
    double = SteppedBackend()
    core = engine.Engine(double, max_batch_size=8)

    async def scenario() -> list[list[int]]:
        first = collect(core, plain("a", 4))
        await step_when_ready(double)  # a's first token
        late = [collect(core, plain("b", 2)), collect(core, plain("a", 3))]  # the same id twice, on purpose
        await until(lambda: core.queue_depth == 3)
        await step_when_ready(double, 3)
        return [await first, await late[0], await late[1]]

    try:
        results = asyncio.run(scenario())
    finally:
        core.close()
    assert results == [[101, 102, 103, 104], [101, 102], [101, 102, 103]]
    assert core.batches == 1 and core.batch_sizes == [3] and core.admitted == 2
    joined = [entry for entry in double.log if entry[0] == "join"]
    assert len(joined) == 1 and len(joined[0][1]) == 2  # type: ignore[arg-type]


def test_a_waiting_weight_write_stops_admission_and_runs_between_batches() -> None:
    double = SteppedBackend()
    core = engine.Engine(double, max_batch_size=8)

    def write() -> bool:
        double.log.append(("write", None))
        return double.generating

    async def scenario() -> tuple[bool, list[int]]:
        first = collect(core, plain("a", 3))
        await step_when_ready(double)
        written = asyncio.ensure_future(core.run_exclusive(write))
        await until(lambda: len(core._queue) == 1)
        late = collect(core, plain("b", 2))  # queued behind the write: must not join batch 1
        await step_when_ready(double, 2)  # a finishes, the batch ends, the write runs
        overlapped = await written
        await step_when_ready(double, 2)
        await first
        return overlapped, await late

    try:
        overlapped, late = asyncio.run(scenario())
    finally:
        core.close()
    assert not overlapped and late == [101, 102]
    assert [entry[0] for entry in double.log] == ["batch", "end", "write", "batch", "end"]
    assert core.admitted == 0


def test_drain_stops_admission_waits_for_admitted_and_queued_then_refits() -> None:
    double = SteppedBackend()
    core = engine.Engine(double, max_batch_size=2)
    assert core.kv_cache_mode == "offload", "the engine takes the backend's KV-cache mode"

    async def scenario() -> list[list[int]]:
        tasks = [collect(core, plain("a", 3))]
        await step_when_ready(double)
        tasks.append(collect(core, plain("b", 3)))  # admitted: the batch has room for 2
        await until(lambda: core.queue_depth == 2)
        await step_when_ready(double)
        await until(lambda: core.admitted == 1)
        tasks.append(collect(core, plain("c", 2)))  # accepted but not admitted (batch full)
        await until(lambda: core.queue_depth == 3)
        suspended = asyncio.ensure_future(core.suspend("drain"))
        await until(lambda: core.state == "suspended")
        with pytest.raises(engine.NotServing):
            await collect(core, plain("refused", 1))
        await step_when_ready(double, 2)  # a and b end; c may not join while the suspend is pending
        await step_when_ready(double, 2)  # c runs as its own batch before the suspend returns
        await suspended
        assert [entry[0] for entry in double.log][-1] == "begin"
        core.resume(weight_version=2)
        tasks.append(collect(core, plain("d", 1)))
        await step_when_ready(double)
        return [await task for task in tasks]

    try:
        results = asyncio.run(scenario())
    finally:
        core.close()
    assert results == [[101, 102, 103], [101, 102, 103], [101, 102], [101]]
    kinds = [entry[0] for entry in double.log]
    assert kinds == ["batch", "join", "end", "batch", "end", "begin", "finish", "batch", "end"]
    assert ("begin", "offload") in double.log and ("finish", "offload") in double.log


def test_a_cancelled_sequence_leaves_the_running_batch_and_frees_its_place() -> None:
    double = SteppedBackend()
    core = engine.Engine(double, max_batch_size=2)

    async def scenario() -> list[int]:
        stream = core.submit(plain("a", 50))
        first = asyncio.ensure_future(anext(stream))
        await step_when_ready(double)
        await first
        second = collect(core, plain("b", 3))
        await until(lambda: core.queue_depth == 2)
        await step_when_ready(double)
        await until(lambda: core.admitted == 1)
        await stream.aclose()  # a's client leaves
        await step_when_ready(double)  # a's next token is dropped; a leaves at the next admission
        await until(lambda: ("leave", ["a"]) in double.log)
        third = collect(core, plain("c", 1))  # takes a's place in the running batch
        await until(lambda: core.queue_depth == 2)
        await step_when_ready(double)
        assert await third == [101]
        return await second

    try:
        assert asyncio.run(scenario()) == [101, 102, 103]
    finally:
        core.close()
    assert core.batches == 1 and core.admitted == 2 and core.queue_depth == 0


def test_suspend_abort_ends_admitted_and_queued_sequences() -> None:
    double = SteppedBackend()
    core = engine.Engine(double, max_batch_size=2)

    async def scenario() -> None:
        first = collect(core, plain("a", 50))
        await step_when_ready(double)
        second = collect(core, plain("b", 50))
        await until(lambda: core.queue_depth == 2)
        await step_when_ready(double)
        await until(lambda: core.admitted == 1)
        queued = collect(core, plain("c", 50))  # no room: waits in the queue
        await until(lambda: core.queue_depth == 3)
        suspended = asyncio.ensure_future(core.suspend("abort"))
        with pytest.raises(engine.Aborted):
            await queued  # ended at once, never started
        await step_when_ready(double)  # a and b are aborted and leave at the next admission
        await suspended
        for task in (first, second):
            with pytest.raises(engine.Aborted):
                await task

    try:
        asyncio.run(scenario())
    finally:
        core.close()
    assert ("leave", ["a", "b"]) in double.log
    assert all(entry[1] != ["c"] for entry in double.log)
    assert [entry[0] for entry in double.log][-1] == "begin"
    assert core.queue_depth == 0 and core.batches == 1


def test_a_sequence_the_backend_cannot_run_fails_alone() -> None:
    class Refusing(SteppedBackend):
        def generate(self, batch: Any, admit: base.Admit | None = None) -> Any:
            yield [base.TokenStep("bad", base.NO_TOKEN, None, finish_reason="abort")]
            yield from super().generate([request for request in batch if request.request_id != "bad"], admit)

    double = Refusing()
    core = engine.Engine(double)

    async def scenario() -> list[int]:
        bad = collect(core, plain("bad", 2))
        good = collect(core, plain("good", 2))
        await asyncio.sleep(0)
        await step_when_ready(double, 2)
        with pytest.raises(engine.EngineError, match="could not run"):
            await bad
        return await good

    try:
        assert asyncio.run(scenario()) == [101, 102]
    finally:
        core.close()
