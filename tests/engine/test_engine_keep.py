"""Refits that keep the sequences in flight (``suspendMode: keep``), as the refit controller runs them
on an engine in this process with the tiny CPU model and a checkpoint source: none of eight running
sequences fails, each shows exactly two version spans with the boundary where the engine parked, and
under ``recompute`` its tokens after the switch are a fresh engine's at the new version; a failure
before the first write lets them go on with the old version (one span), one after it ends them with
the refit's error; a KV-cache mode the backend cannot keep under drains instead, and says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import keep_harness as harness
from megafleet_engine import engine
from megafleet_engine.backends import transformers_backend
from megafleet_engine.openai import version_spans
from megafleet_engine.refit_attempts import controller as refit_controller
from megafleet_engine.refit_attempts import phases
from megafleet_engine.refit_attempts.sources import checkpoint, rendezvous
from megafleet_protocol import vocabulary

Span = version_spans.Span
MAX_TOKENS = 120

pytestmark = pytest.mark.slow  # each test runs the tiny model for a few hundred steps


@pytest.fixture(scope="module")
def backend() -> transformers_backend.TransformersBackend:
    return harness.fresh_backend()


@pytest.fixture
def core(backend: transformers_backend.TransformersBackend) -> Iterator[engine.Engine]:
    backend.load_checkpoint(harness.SOURCE)
    the_engine = engine.Engine(backend, max_batch_size=16)
    yield the_engine
    the_engine.close()


def keep(
    version: int, kv_cache_mode: vocabulary.KvCacheMode, path: str = harness.NEW_SOURCE
) -> checkpoint.CheckpointRequest:
    return checkpoint.CheckpointRequest(
        version=version, path=path, timeout_seconds=60, suspend_mode="keep", kv_cache_mode=kv_cache_mode
    )


async def refit_while_running(
    core: engine.Engine, request: checkpoint.CheckpointRequest | rendezvous.RendezvousRequest
) -> tuple[refit_controller.RefitController, harness.Together]:
    """Eight sequences running as one batch; the refit starts once each has a few tokens."""
    running = await harness.Together.start(core, harness.PROMPTS, MAX_TOKENS)
    await harness.until(lambda: min(running.counts()) >= 5, "every sequence produced a few tokens")
    refits = refit_controller.RefitController(core)
    refits.start(request, asyncio.get_running_loop())
    return refits, running


async def finished(refits: refit_controller.RefitController) -> phases.Snapshot:
    await harness.until(lambda: refits.snapshot().phase in ("succeeded", "failed"), "the refit's outcome")
    return refits.snapshot()


@pytest.mark.parametrize("kv_cache_mode", ["persist", "recompute"])
def test_keep_carries_eight_running_sequences_across_the_refit(
    core: engine.Engine, kv_cache_mode: vocabulary.KvCacheMode
) -> None:
    async def scenario() -> tuple[phases.Snapshot, list[list[int]], harness.Together, bool]:
        refits, running = await refit_while_running(core, keep(1, kv_cache_mode))
        status = await finished(refits)
        return status, await running.finished(), running, refits.dirty

    status, tokens, running, dirty = asyncio.run(scenario())
    assert status.phase == "succeeded", status.error
    assert all(len(sequence) == MAX_TOKENS for sequence in tokens), "no kept sequence failed"
    boundaries = []
    for index in range(len(tokens)):
        first, second = running.spans(index)  # exactly two spans
        assert first == Span(0, 0) and (second.version, second.kv) == (1, kv_cache_mode)
        assert 0 < second.start < MAX_TOKENS
        boundaries.append(second.start)
    assert [name for name, _ in status.phases] == ["pause", "apply", "switch"]
    in_flight = status.in_flight
    assert in_flight is not None
    assert (in_flight.requested, in_flight.effective, in_flight.kv_cache_mode) == ("keep", "keep", kv_cache_mode)
    assert (in_flight.reason, in_flight.kept, in_flight.drained, in_flight.aborted) == (None, len(tokens), 0, 0)
    assert status.staging == phases.Staging(requested="off", effective="inPlace")
    assert status.pause is not None and status.pause.stall_seconds > 0 and status.pause.gate_closed_seconds == 0
    assert (core.state, core.weight_version, core.weight_kv, dirty) == ("ready", 1, kv_cache_mode, False)
    prefixes = [prompt + done[:cut] for prompt, done, cut in zip(harness.PROMPTS, tokens, boundaries, strict=True)]
    if kv_cache_mode == "persist":
        assert in_flight.recomputed_tokens == 0 and status.pause.recompute_seconds == 0
        return
    assert in_flight.recomputed_tokens == sum(map(len, prefixes)) and status.pause.recompute_seconds > 0
    expected = harness.fresh_greedy(core.backend, prefixes, [MAX_TOKENS - cut for cut in boundaries])
    assert [done[cut:] for done, cut in zip(tokens, boundaries, strict=True)] == expected


def test_a_failure_before_the_first_write_lets_the_kept_sequences_go_on_with_one_span(core: engine.Engine) -> None:
    """A rendezvous whose trainer never comes: the engine is paused while the attempt joins, the
    abort unpauses it, and the kept sequences finish on the old version."""
    request = rendezvous.RendezvousRequest(
        version=1, address="127.0.9.1", port=9, world_size=2, rank_offset=1, timeout_seconds=20, suspend_mode="keep"
    )

    async def scenario() -> tuple[phases.Snapshot, list[list[int]], harness.Together]:
        refits, running = await refit_while_running(core, request)
        await harness.until(lambda: core.paused, "the engine parked for the refit")
        refits.abort("the trainer is gone")
        status = await finished(refits)
        return status, await running.finished(), running

    status, tokens, running = asyncio.run(scenario())
    assert status.phase == "failed" and status.error == "aborted: the trainer is gone"
    assert all(len(sequence) == MAX_TOKENS for sequence in tokens)
    assert all(running.spans(index) == (Span(0, 0),) for index in range(len(tokens)))
    assert tokens == harness.fresh_greedy(core.backend, harness.PROMPTS, [MAX_TOKENS] * len(tokens))
    assert (core.state, core.weight_version) == ("stale", 0)  # in place: the shard is fenced as before


def test_a_failure_after_a_write_ends_the_kept_sequences_with_the_refits_error(
    core: engine.Engine, tmp_path: Path
) -> None:
    """A checkpoint folder without the weights: the write fails on the parked thread, so the engine
    must assume part of the version is in place."""

    async def scenario() -> tuple[phases.Snapshot, BaseException | None]:
        refits, running = await refit_while_running(core, keep(1, "persist", path=str(tmp_path)))
        status = await finished(refits)
        failure = await asyncio.gather(running.reader, return_exceptions=True)
        return status, failure[0] if isinstance(failure[0], BaseException) else None

    status, kept = asyncio.run(scenario())
    assert status.phase == "failed" and "lacks" in (status.error or "")
    assert isinstance(kept, engine.EngineError) and not isinstance(kept, engine.NotServing)
    assert str(kept) == f"refit to v1 failed after its weights were written: {status.error}"
    assert (core.state, core.weight_version) == ("stale", 0) and not core.paused


def test_a_kv_cache_mode_the_backend_cannot_keep_under_drains_and_says_so(core: engine.Engine) -> None:
    async def scenario() -> tuple[phases.Snapshot, list[list[int]], harness.Together]:
        refits, running = await refit_while_running(core, keep(1, "offload"))
        status = await finished(refits)
        return status, await running.finished(), running

    status, tokens, running = asyncio.run(scenario())
    assert status.phase == "succeeded", status.error
    assert status.in_flight == phases.InFlight(
        requested="keep",
        effective="drain",
        kv_cache_mode="offload",
        reason="the transformers backend keeps with persist or recompute, not offload; drained",
        drained=len(tokens),
    )
    assert [name for name, _ in status.phases] == ["suspend", "apply", "resume"]
    assert status.pause is not None and status.pause.gate_closed_seconds >= status.pause.stall_seconds > 0
    assert all(running.spans(index) == (Span(0, 0),) for index in range(len(tokens)))  # drained on the old version
    assert (core.state, core.weight_version, core.weight_kv) == ("ready", 1, None)
    core.backend.load_checkpoint(harness.SOURCE)
    assert tokens == harness.fresh_greedy(core.backend, harness.PROMPTS, [MAX_TOKENS] * len(tokens))


def test_a_checkpoint_that_does_not_exist_fails_before_the_engine_is_touched(core: engine.Engine) -> None:
    """Nothing in flight is disturbed by a refit whose checkpoint is not there: it fails before the pause."""

    async def scenario() -> tuple[phases.Snapshot, list[list[int]], harness.Together]:
        refits, running = await refit_while_running(core, keep(1, "persist", path="/nonexistent/checkpoint"))
        status = await finished(refits)
        return status, await running.finished(), running

    status, tokens, running = asyncio.run(scenario())
    assert status.phase == "failed" and "does not exist" in (status.error or "")
    assert all(running.spans(index) == (Span(0, 0),) for index in range(len(tokens)))
    assert tokens == harness.fresh_greedy(core.backend, harness.PROMPTS, [MAX_TOKENS] * len(tokens))
    assert core.weight_version == 0 and not core.paused  # stale, as after any failed attempt: the operator decides
