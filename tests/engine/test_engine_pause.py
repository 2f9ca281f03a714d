"""The engine's pause point (``Engine.pause``, ``switch``, ``unpause``) on the tiny CPU model: the
backend thread parks between two steps with every sequence in place, weights are written there, and
the switch stamps the new version from the next step on, so every sequence shows exactly two version
spans whose boundary is the number of tokens it had when the engine parked. Under ``recompute`` the
tokens after the switch are a fresh engine's at the new version from the prefix; under ``persist``
those of the prefix's old KV continued with the new weights. Also: a pause between batches, requests
arriving during a pause, and releases without a switch (a backend that cannot keep:
test_engine_keepless.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import parser

from helpers import keep_harness as harness
from megafleet_engine import engine, metrics, pause_point
from megafleet_engine.backends import transformers_backend
from megafleet_engine.openai import version_spans

Span = version_spans.Span
MAX_TOKENS = 120

pytestmark = pytest.mark.slow  # each test runs the tiny model for a few hundred steps


@pytest.fixture(scope="module")
def backend() -> transformers_backend.TransformersBackend:
    return harness.fresh_backend()


@pytest.fixture
def core(backend: transformers_backend.TransformersBackend) -> Iterator[engine.Engine]:
    backend.load_checkpoint(harness.SOURCE)  # every test starts at version 0's weights
    the_engine = engine.Engine(backend, max_batch_size=16)
    yield the_engine
    the_engine.close()


async def write_new_weights(core: engine.Engine) -> None:
    await core.run_exclusive(lambda: core.backend.load_checkpoint(harness.NEW_SOURCE))


async def paused_mid_batch(core: engine.Engine) -> tuple[harness.Together, list[int]]:
    """Eight sequences running as one batch, the engine parked once each has a few tokens; returns
    them and how many tokens each had delivered when it parked."""
    running = await harness.Together.start(core, harness.PROMPTS, MAX_TOKENS)
    await harness.until(lambda: min(running.counts()) >= 5, "every sequence produced a few tokens")
    await core.pause()
    parked = running.counts()
    await asyncio.sleep(0.05)
    assert running.counts() == parked, "a token arrived while the engine was parked"
    assert core.paused and core.state == "ready"
    return running, parked


@pytest.mark.parametrize("kv_cache_mode", ["persist", "recompute"])
def test_a_switch_between_two_steps_gives_every_sequence_two_spans_at_the_exact_boundary(
    core: engine.Engine, kv_cache_mode: str
) -> None:
    async def scenario() -> tuple[list[list[int]], list[int], harness.Together, pause_point.Paused]:
        running, parked = await paused_mid_batch(core)
        await write_new_weights(core)  # on the parked thread
        paused = await core.switch(1, kv_cache_mode, staged=False)  # type: ignore[arg-type]
        return await running.finished(), parked, running, paused

    tokens, parked, running, paused = asyncio.run(scenario())
    assert all(len(sequence) == MAX_TOKENS for sequence in tokens), "no kept sequence failed or ended early"
    for index, boundary in enumerate(parked):
        assert running.spans(index) == (Span(0, 0), Span(boundary, 1, kv_cache_mode)), index
    assert (core.weight_version, core.weight_kv) == (1, kv_cache_mode)
    assert paused.kept == len(harness.PROMPTS) and not paused.between_batches
    assert paused.stall_seconds >= paused.recompute_seconds >= 0.0
    if kv_cache_mode == "recompute":
        prefixes = [prompt + done[:cut] for prompt, done, cut in zip(harness.PROMPTS, tokens, parked, strict=True)]
        assert paused.recomputed_tokens == sum(len(prefix) for prefix in prefixes) > 0
        assert core.pauses.recomputed_tokens == paused.recomputed_tokens
        expected = harness.fresh_greedy(core.backend, prefixes, [MAX_TOKENS - boundary for boundary in parked])
        assert [done[boundary:] for done, boundary in zip(tokens, parked, strict=True)] == expected
    else:
        assert paused.recomputed_tokens == 0
    scraped = metrics.Metrics(core)
    scraped.observe_refit_stall(paused.stall_seconds)
    samples = {
        sample.name: sample.value
        for family in parser.text_string_to_metric_families(scraped.exposition().decode())
        for sample in family.samples
    }
    assert samples["megafleet_refit_kept_sequences_total"] == len(harness.PROMPTS)
    assert samples["megafleet_refit_recomputed_tokens_total"] == paused.recomputed_tokens
    assert samples["megafleet_refit_stall_seconds_count"] == 1


def test_persist_continues_the_old_kv_with_the_new_weights(core: engine.Engine) -> None:
    async def scenario() -> tuple[list[list[int]], list[int]]:
        running, parked = await paused_mid_batch(core)
        await write_new_weights(core)
        await core.switch(1, "persist", staged=False)
        return await running.finished(), parked

    tokens, parked = asyncio.run(scenario())
    backend = core.backend
    assert isinstance(backend, transformers_backend.TransformersBackend)
    backend.load_checkpoint(harness.SOURCE)  # the replay builds the prefix KV with the old weights
    for prompt, done, boundary in list(zip(harness.PROMPTS, tokens, parked, strict=True))[:3]:
        replayed = harness.kv_replay(backend.model, prompt, done[:boundary], MAX_TOKENS - boundary, harness.NEW_SOURCE)
        assert done[boundary:] == replayed


def test_requests_arriving_during_a_pause_queue_and_run_on_the_new_version(core: engine.Engine) -> None:
    async def scenario() -> tuple[list[list[int]], harness.Together]:
        running, _ = await paused_mid_batch(core)
        late = await harness.Together.start(core, harness.PROMPTS[:2], 6)  # the gate is open
        await asyncio.sleep(0.05)
        assert late.counts() == [0, 0], "nothing runs while the engine is parked"
        await write_new_weights(core)
        await core.switch(1, "persist", staged=False)
        await running.finished()
        return await late.finished(), late

    late_tokens, late = asyncio.run(scenario())
    assert late.spans(0) == (Span(0, 1),) and late.spans(1) == (Span(0, 1),)
    assert late_tokens == harness.fresh_greedy(core.backend, harness.PROMPTS[:2], [6, 6])


def test_a_pause_between_batches_switches_with_nothing_kept(core: engine.Engine) -> None:
    async def scenario() -> tuple[pause_point.Paused, list[list[int]]]:
        await core.pause()
        await write_new_weights(core)
        paused = await core.switch(4, "recompute", staged=False)
        after = await harness.Together.start(core, harness.PROMPTS[:3], 5)
        return paused, await after.finished()

    paused, tokens = asyncio.run(scenario())
    assert paused.between_batches and (paused.kept, paused.recomputed_tokens) == (0, 0)
    assert core.weight_version == 4 and not core.paused
    assert tokens == harness.fresh_greedy(core.backend, harness.PROMPTS[:3], [5, 5, 5])


def test_unpause_without_a_write_lets_every_sequence_go_on_with_one_span(core: engine.Engine) -> None:
    async def scenario() -> tuple[list[list[int]], harness.Together]:
        running, _ = await paused_mid_batch(core)
        core.unpause()
        return await running.finished(), running

    tokens, running = asyncio.run(scenario())
    assert all(len(sequence) == MAX_TOKENS for sequence in tokens)
    assert all(running.spans(index) == (Span(0, 0),) for index in range(len(tokens)))
    assert tokens == harness.fresh_greedy(core.backend, harness.PROMPTS, [MAX_TOKENS] * len(tokens))


def test_unpause_after_a_write_ends_the_kept_and_the_queued_sequences(core: engine.Engine) -> None:
    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        running, _ = await paused_mid_batch(core)
        late = await harness.Together.start(core, harness.PROMPTS[:1], 4)
        await write_new_weights(core)
        core.mark("stale", "refit to v1 failed")
        core.unpause(error="refit to v1 failed after its weights were written: the trainer died")
        results = await asyncio.gather(running.reader, late.reader, return_exceptions=True)
        return tuple(result if isinstance(result, BaseException) else None for result in results)  # type: ignore[return-value]

    kept, queued = asyncio.run(scenario())
    assert isinstance(kept, engine.EngineError) and not isinstance(kept, engine.NotServing)
    assert str(kept) == "refit to v1 failed after its weights were written: the trainer died"
    assert isinstance(queued, engine.NotServing) and queued.state == "stale"
    assert core.queue_depth == 0 and not core.paused


def test_a_pause_taken_back_before_the_thread_parks_fails_the_pause(core: engine.Engine) -> None:
    async def scenario() -> None:
        running = await harness.Together.start(core, harness.PROMPTS[:2], MAX_TOKENS)
        await harness.until(lambda: min(running.counts()) >= 1, "the batch running")
        pausing = asyncio.ensure_future(core.pause())
        await asyncio.sleep(0)  # the pause is asked for
        assert core.pauses.requested
        core.unpause()  # either takes the request back or releases the parked thread
        try:
            await pausing
        except engine.EngineError as error:
            assert "taken back" in str(error)
        await running.finished()

    asyncio.run(scenario())
    assert not core.paused and not core.pauses.requested
