"""Requests that arrive while the engine is suspended for a refit wait at the gate and run on the new
weights, so no request fails around a refit: on a backend double whose tokens name the weights that made them, and
through the frontend's HTTP API (``/health`` and a completion held across a refit's suspend).

Bounded by ``refit_wait_seconds``; a drain still drains what was accepted before the suspend; a
failed refit, a plain suspend (fencing, draining before removal) and a wait of 0 answer at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import engine_harness as harness
from megafleet_engine import engine
from megafleet_engine.backends import base
from megafleet_protocol import vocabulary


class VersionedBackend(base.InPlaceOnly):
    """A backend double: the n-th token of a sequence is ``1000 * version + n``, where ``version``
    is what the last weight write set; each step waits for ``flowing`` (so a test can keep a batch
    in flight)."""

    supports_admission = False
    kv_cache_mode: vocabulary.KvCacheMode = "persist"
    tokenizer = None
    follows = False
    spans_ranks = False

    def __init__(self) -> None:
        self.info = base.ModelInfo(name="double", max_sequence_length=512, vocab_size=100_000, eos_token_id=None)
        self.version = 0
        self.flowing = threading.Event()
        self.flowing.set()
        self.started = threading.Event()

    def generate(self, batch: Any, admit: base.Admit | None = None) -> Any:
        self.started.set()
        running = {request.request_id: request for request in batch}
        step = 0
        while running:
            assert self.flowing.wait(10), "the test never let the batch go on"
            step += 1
            steps = []
            for key, request in list(running.items()):
                done = step >= request.params.max_tokens
                steps.append(
                    base.TokenStep(key, 1000 * self.version + step, None, finish_reason="length" if done else None)
                )
                if done:
                    del running[key]
            yield steps

    def parameters(self) -> dict[str, torch.Tensor]:
        return {}

    def load_checkpoint(self, source: str, *, staged: bool = False) -> None:
        pass

    def begin_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        pass

    def finish_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        pass

    def shard_map(self) -> None:
        return None

    def settle_weight_update(self, version: int, *, ok: bool, timeout_seconds: float) -> bool:
        return ok

    def serve_followers(self) -> None:
        raise AssertionError("a single-process double has no followers")

    def close(self) -> None:
        pass


def request(request_id: str, max_tokens: int = 2) -> base.SequenceRequest:
    return base.SequenceRequest(request_id, (1, 2, 3), base.SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def tokens(core: engine.Engine, sequence: base.SequenceRequest) -> list[int]:
    return [step.token_id async for step in core.submit(sequence)]


async def until(condition: Any, what: str) -> None:
    """Wait for ``condition()`` on the engine's own state (it has no event for these counters)."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not reached in 10 s"
        await asyncio.sleep(0.005)


async def refit(core: engine.Engine, double: VersionedBackend, version: int) -> None:
    """What a refit attempt does once suspended: write the weights, then resume at ``version``."""

    def write() -> None:
        double.version = version

    await core.run_exclusive(write)
    core.resume(weight_version=version)


@pytest.fixture
def double() -> VersionedBackend:
    return VersionedBackend()


@pytest.fixture
def core(double: VersionedBackend) -> Iterator[engine.Engine]:
    the_engine = engine.Engine(double, max_batch_size=8, refit_wait_seconds=30)
    yield the_engine
    the_engine.close()


def test_a_request_during_a_refit_waits_and_runs_on_the_new_weights(
    core: engine.Engine, double: VersionedBackend
) -> None:
    async def scenario() -> list[int]:
        await core.suspend("drain", hold=True)
        assert core.accepting  # what /health reports
        held = asyncio.ensure_future(tokens(core, request("r")))
        await until(lambda: core.held_now == 1, "the request waiting at the gate")
        assert not held.done() and core.queue_depth == 0
        await refit(core, double, 1)
        return await asyncio.wait_for(held, 10)

    assert asyncio.run(scenario()) == [1001, 1002]
    assert (core.held, core.held_now, core.weight_version) == (1, 0, 1)


def test_sequences_queued_together_count_one_by_one_while_held(core: engine.Engine, double: VersionedBackend) -> None:
    """A multi-prompt request, or the API server's batch of requests, waits at the gate as one entry:
    the waiting-sequences gauge an autoscaler reads must still count each of its sequences."""

    def sink(items: Any) -> None:
        pass

    async def scenario() -> None:
        await core.suspend("drain", hold=True)
        entries = [(tag, request(tag)) for tag in ("a", "b", "c")]
        held = asyncio.ensure_future(core.enqueue(entries, sink))
        single = asyncio.ensure_future(tokens(core, request("d")))
        await until(lambda: core.held_now == 4, "four sequences waiting at the gate")
        assert core.waiting == 4 and core.queue_depth == 0
        await refit(core, double, 1)
        await asyncio.wait_for(held, 10)
        assert await asyncio.wait_for(single, 10) == [1001, 1002]

    asyncio.run(scenario())
    assert (core.held, core.held_now) == (4, 0)


def test_a_drain_for_a_refit_drains_what_runs_while_new_requests_wait(
    core: engine.Engine, double: VersionedBackend
) -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        double.flowing.clear()
        running = asyncio.ensure_future(tokens(core, request("old", max_tokens=3)))
        assert await asyncio.to_thread(double.started.wait, 10)
        suspending = asyncio.ensure_future(core.suspend("drain", hold=True, timeout_seconds=20))
        await until(lambda: core.state == "suspended", "the gate closed")
        held = asyncio.ensure_future(tokens(core, request("new")))
        await until(lambda: core.held_now == 1, "the new request waiting")
        assert not suspending.done()  # the drain waits for the running request only
        double.flowing.set()
        await asyncio.wait_for(suspending, 10)  # no deadlock: the waiting request is not in flight
        assert not held.done()
        await refit(core, double, 7)
        return await asyncio.wait_for(running, 10), await asyncio.wait_for(held, 10)

    old, new = asyncio.run(scenario())
    assert old == [1, 2, 3], "the drained request ran to its end on the old weights"
    assert new == [7001, 7002]


def test_an_abort_for_a_refit_does_not_abort_the_waiting_requests(
    core: engine.Engine, double: VersionedBackend
) -> None:
    async def scenario() -> list[int]:
        await core.suspend("abort", hold=True)
        held = asyncio.ensure_future(tokens(core, request("r")))
        await until(lambda: core.held_now == 1, "the request waiting")
        await core.suspend("abort", hold=True)  # a second abort (an attempt's retry) leaves it waiting
        await refit(core, double, 2)
        return await asyncio.wait_for(held, 10)

    assert asyncio.run(scenario()) == [2001, 2002]


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_the_wait_is_bounded_by_the_setting(double: VersionedBackend) -> None:
    core = engine.Engine(double, refit_wait_seconds=0.3)

    async def scenario() -> tuple[engine.NotServing, float]:
        await core.suspend("drain", hold=True)
        started = time.monotonic()
        with pytest.raises(engine.NotServing) as refused:
            await tokens(core, request("r"))
        return refused.value, time.monotonic() - started

    try:
        refused, took = asyncio.run(scenario())
    finally:
        core.close()
    assert refused.state == "suspended" and refused.waited is not None and 0.3 <= took < 5
    assert "held 0 s for a refit that did not finish" in str(refused)
    assert core.held_now == 0


def test_a_failed_refit_answers_the_waiting_requests_at_once(core: engine.Engine) -> None:
    async def scenario() -> tuple[engine.NotServing, float]:
        await core.suspend("drain", hold=True)
        held = asyncio.ensure_future(tokens(core, request("r")))
        await until(lambda: core.held_now == 1, "the request waiting")
        started = time.monotonic()
        core.mark("stale", "the transfer failed")
        with pytest.raises(engine.NotServing) as refused:
            await asyncio.wait_for(held, 10)
        return refused.value, time.monotonic() - started

    refused, took = asyncio.run(scenario())
    assert refused.state == "stale" and took < 5  # not at the 30 s bound
    assert not core.accepting


@pytest.mark.parametrize(
    ("wait", "hold"), [(0.0, True), (30.0, False)], ids=["wait-zero-answers-at-once", "plain-suspend-answers-at-once"]
)
def test_without_a_refit_hold_the_gate_answers_at_once(double: VersionedBackend, wait: float, hold: bool) -> None:
    core = engine.Engine(double, refit_wait_seconds=wait)

    async def scenario() -> engine.NotServing:
        await core.suspend("abort", hold=hold)
        with pytest.raises(engine.NotServing) as refused:
            await asyncio.wait_for(tokens(core, request("r")), 5)
        return refused.value

    try:
        refused = asyncio.run(scenario())
    finally:
        core.close()
    assert refused.state == "suspended" and refused.waited is None
    assert core.held == 0 and not core.accepting


def test_a_client_that_leaves_while_waiting_is_dropped(core: engine.Engine, double: VersionedBackend) -> None:
    async def scenario() -> None:
        await core.suspend("drain", hold=True)
        held = asyncio.ensure_future(tokens(core, request("gone")))
        await until(lambda: core.held_now == 1, "the request waiting")
        held.cancel()
        await asyncio.wait({held})
        assert core.held_now == 0
        await refit(core, double, 3)
        assert await tokens(core, request("next", max_tokens=1)) == [3001]

    asyncio.run(scenario())
    assert core.batches == 1 and core.batch_sizes == [1], "the cancelled request never ran"


# -- through HTTP: /health and a completion held across a refit's suspend ------------------------


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.Served]:
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path)) as running:
        yield running


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_health_stays_ready_and_a_completion_is_held_across_a_refit_suspend(served: harness.Served) -> None:
    answers: list[Any] = []
    with served.http() as http, served.openai_client() as client:
        asyncio.run(served.engine.suspend("drain", hold=True))
        health = http.get("/health")
        assert (health.status_code, health.json()) == (200, {"status": "refitting"})

        def complete() -> None:
            answers.append(client.completions.with_raw_response.create(model=harness.MODEL, prompt="hi", max_tokens=2))

        thread = threading.Thread(target=complete)
        thread.start()
        deadline = time.monotonic() + 10
        while served.engine.held_now == 0:  # the engine's own counter: no event to wait on
            assert time.monotonic() < deadline, "the request never reached the gate"
            time.sleep(0.01)
        served.engine.resume(weight_version=4)
        thread.join(timeout=30)
        assert answers and answers[0].headers["x-megafleet-weight-version"] == "4"
        with served.agent() as agent:
            agent.post("/v1/suspend", json={"mode": "drain", "timeoutSeconds": 5})  # a plain suspend
            assert http.get("/health").status_code == 503
