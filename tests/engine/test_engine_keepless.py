"""A backend that cannot keep sequences across a refit (no ``keep_modes``, as megatron's for now), on a
backend double: the engine never hands it ``admit`` nor parks inside its batch (a pause waits for the
batch to end, then parks between batches), and a refit asking it to keep drains instead and says why.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from megafleet_engine import engine
from megafleet_engine.backends import base
from megafleet_engine.refit_attempts import controller as refit_controller
from megafleet_engine.refit_attempts import phases
from megafleet_engine.refit_attempts.sources import checkpoint
from megafleet_protocol import vocabulary


class KeeplessBackend(base.InPlaceOnly):
    """The n-th token of a sequence is ``1000 * version + n``, where ``version`` is what the last
    checkpoint named; each step waits for ``flowing`` (so a test can keep a batch in flight)."""

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
        self.given_admit: list[bool] = []

    def generate(self, batch: Any, admit: base.Admit | None = None) -> Any:
        self.given_admit.append(admit is not None)
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

    def shard_map(self) -> None:
        return None

    def load_checkpoint(self, source: str, *, staged: bool = False) -> None:
        self.version = int(source)

    def begin_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        pass

    def finish_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        pass

    def settle_weight_update(self, version: int, *, ok: bool, timeout_seconds: float) -> bool:
        return ok

    def serve_followers(self) -> None:
        raise AssertionError("a single-process double has no followers")

    def close(self) -> None:
        pass


def request(request_id: str, max_tokens: int = 3) -> base.SequenceRequest:
    return base.SequenceRequest(request_id, (1, 2, 3), base.SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def tokens(core: engine.Engine, sequence: base.SequenceRequest) -> list[int]:
    return [step.token_id async for step in core.submit(sequence)]


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not reached in 10 s"
        await asyncio.sleep(0.002)


@pytest.fixture
def double() -> KeeplessBackend:
    return KeeplessBackend()


@pytest.fixture
def core(double: KeeplessBackend) -> Iterator[engine.Engine]:
    the_engine = engine.Engine(double, max_batch_size=8)
    yield the_engine
    the_engine.close()


def test_a_pause_waits_for_the_batch_and_parks_between_batches(core: engine.Engine, double: KeeplessBackend) -> None:
    async def scenario() -> tuple[list[int], list[int], bool]:
        double.flowing.clear()
        running = asyncio.ensure_future(tokens(core, request("old")))
        assert await asyncio.to_thread(double.started.wait, 10)
        pausing = asyncio.ensure_future(core.pause())
        await asyncio.sleep(0.05)
        parked_mid_batch = core.paused
        double.flowing.set()
        await asyncio.wait_for(pausing, 10)
        await core.run_exclusive(lambda: double.load_checkpoint("7"))
        paused = await core.switch(7, "persist", staged=False)
        assert paused.between_batches and paused.kept == 0
        return await running, await tokens(core, request("new")), parked_mid_batch

    old, new, parked_mid_batch = asyncio.run(scenario())
    assert not parked_mid_batch, "a backend that cannot keep must not be paused inside its batch"
    assert (old, new) == ([1, 2, 3], [7001, 7002, 7003])
    assert double.given_admit == [False, False], "no admit for a backend that neither admits nor keeps"


def test_a_keep_refit_on_a_backend_that_cannot_keep_drains_and_says_so(
    core: engine.Engine, double: KeeplessBackend
) -> None:
    refit = checkpoint.CheckpointRequest(version=2, path="2", timeout_seconds=30, suspend_mode="keep")

    async def scenario() -> tuple[phases.Snapshot, list[int]]:
        double.flowing.clear()
        running = asyncio.ensure_future(tokens(core, request("old")))
        assert await asyncio.to_thread(double.started.wait, 10)
        refits = refit_controller.RefitController(core)
        refits.start(refit, asyncio.get_running_loop())
        await until(lambda: core.state == "suspended", "the gate closed for the drain")
        double.flowing.set()
        await until(lambda: refits.snapshot().phase in ("succeeded", "failed"), "the refit's outcome")
        return refits.snapshot(), await running

    status, old = asyncio.run(scenario())
    assert status.phase == "succeeded", status.error
    assert status.in_flight == phases.InFlight(
        requested="keep",
        effective="drain",
        kv_cache_mode="persist",
        reason="the keepless backend cannot keep sequences across a refit; drained",
        drained=1,
    )
    assert old == [1, 2, 3] and core.weight_version == 2 and core.pauses.kept_sequences == 0
