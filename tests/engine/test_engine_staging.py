"""Staged refits (``staging: auto``) on an engine in this process with the tiny CPU model: the
checkpoint is loaded into the backend's staging copy on the attempt's thread while the engine keeps
generating (the load below returns only once the engine delivered more tokens, which a paused or
suspended engine never would), the copy goes live at a step boundary and the pause covers the switch
only; a staged refit that fails discards the copy and the old version serves on, never paused; drain
with staging drains after the transfer; ``required`` without a copy fails and touches nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

from helpers import keep_harness as harness
from megafleet_engine import engine, refit_staging
from megafleet_engine.backends import transformers_backend
from megafleet_engine.models import tiny
from megafleet_engine.openai import version_spans
from megafleet_engine.refit_attempts import controller as refit_controller
from megafleet_engine.refit_attempts import phases
from megafleet_engine.refit_attempts.sources import checkpoint
from megafleet_protocol import vocabulary

Span = version_spans.Span
MAX_TOKENS = 120
TOKENS_WHILE_STAGING = 16

pytestmark = pytest.mark.slow  # each test runs the tiny model for a few hundred steps


class ServingWhileStaging(transformers_backend.TransformersBackend):
    """The tiny backend whose staged checkpoint load finishes only once ``engine`` has delivered
    :data:`TOKENS_WHILE_STAGING` more tokens (the load overlaps generation), and then fails when
    ``fail`` is set; it counts the discards of its staging copy."""

    engine: engine.Engine
    fail = False
    discarded = 0
    tokens_while_staging = 0

    def load_checkpoint(self, source: str, *, staged: bool = False) -> None:
        if staged:
            before = self.engine.generated_tokens
            deadline = time.monotonic() + 30
            while self.engine.generated_tokens < before + TOKENS_WHILE_STAGING:
                assert time.monotonic() < deadline, "the engine generated nothing while the refit staged"
                time.sleep(0.001)
            self.tokens_while_staging = self.engine.generated_tokens - before
        super().load_checkpoint(source, staged=staged)
        if staged and self.fail:
            raise RuntimeError("the staged checkpoint is corrupt")

    def discard_staged(self) -> None:
        self.discarded += 1


@pytest.fixture(scope="module")
def backend() -> ServingWhileStaging:
    model, tokenizer = tiny.build_tiny(harness.SOURCE)
    staging = ServingWhileStaging(model, tokenizer, name="tiny", max_sequence_length=harness.MAX_SEQUENCE_LENGTH)
    staging.prepare_staging()
    return staging


@pytest.fixture
def core(backend: ServingWhileStaging) -> Iterator[engine.Engine]:
    backend.load_checkpoint(harness.SOURCE)
    backend.fail, backend.discarded, backend.tokens_while_staging = False, 0, 0
    the_engine = engine.Engine(backend, max_batch_size=16)
    the_engine.staging = refit_staging.StagingPlan("auto", bytes=backend.staging_bytes())
    backend.engine = the_engine
    yield the_engine
    the_engine.close()


def staged(
    in_flight: vocabulary.InFlightMode, staging: vocabulary.StagingMode = "auto"
) -> checkpoint.CheckpointRequest:
    return checkpoint.CheckpointRequest(
        version=1,
        path=harness.NEW_SOURCE,
        timeout_seconds=60,
        suspend_mode=in_flight,
        kv_cache_mode="persist",
        staging=staging,
    )


async def refit_while_running(
    core: engine.Engine, request: checkpoint.CheckpointRequest
) -> tuple[phases.Snapshot, list[list[int]], harness.Together]:
    """Eight sequences running as one batch, the refit started once each has a few tokens; its
    outcome and the sequences' tokens once both ended."""
    running = await harness.Together.start(core, harness.PROMPTS, MAX_TOKENS)
    await harness.until(lambda: min(running.counts()) >= 5, "every sequence produced a few tokens")
    refits = refit_controller.RefitController(core)
    refits.start(request, asyncio.get_running_loop())
    await harness.until(lambda: refits.snapshot().phase in ("succeeded", "failed"), "the refit's outcome")
    return refits.snapshot(), await running.finished(), running


def live_weights(core: engine.Engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in core.backend.parameters().items()}


def test_a_staged_keep_refit_receives_while_serving_and_pauses_only_for_the_switch(
    core: engine.Engine, backend: ServingWhileStaging
) -> None:
    pointers = {name: tensor.data_ptr() for name, tensor in backend.parameters().items()}
    status, tokens, running = asyncio.run(refit_while_running(core, staged("keep")))

    assert status.phase == "succeeded", status.error
    assert backend.tokens_while_staging >= TOKENS_WHILE_STAGING
    assert all(len(sequence) == MAX_TOKENS for sequence in tokens)
    for index in range(len(tokens)):
        first, second = running.spans(index)
        assert first == Span(0, 0) and (second.version, second.kv) == (1, "persist")
        assert 0 < second.start < MAX_TOKENS
    assert status.staging == phases.Staging(requested="auto", effective="staged", bytes=backend.staging_bytes())
    assert status.in_flight is not None and status.in_flight.kept == len(tokens)
    assert [name for name, _ in status.phases] == ["pause", "apply", "switch"]
    pause = status.pause
    assert pause is not None and pause.stall_seconds >= pause.switch_seconds > 0 and pause.gate_closed_seconds == 0
    new = tiny.reference_weights(harness.NEW_SOURCE)
    for name, tensor in backend.parameters().items():
        assert tensor.data_ptr() == pointers[name], f"{name} was rebound"
        assert torch.equal(tensor, new[name]), name
    assert (core.state, core.weight_version) == ("ready", 1) and backend.discarded == 0


def test_a_staged_refit_that_fails_discards_the_copy_and_the_old_version_serves_on(
    core: engine.Engine, backend: ServingWhileStaging
) -> None:
    backend.fail = True
    before = live_weights(core)
    status, tokens, running = asyncio.run(refit_while_running(core, staged("keep")))

    assert status.phase == "failed" and "the staged checkpoint is corrupt" in (status.error or "")
    assert backend.tokens_while_staging >= TOKENS_WHILE_STAGING and backend.discarded == 1
    assert status.pause is None, "no pause ever happened"
    assert all(running.spans(index) == (Span(0, 0),) for index in range(len(tokens)))
    assert (core.state, core.weight_version, core.paused) == ("ready", 0, False)
    for name, tensor in backend.parameters().items():
        assert torch.equal(tensor, before[name]), f"{name} changed although the refit failed"
    assert tokens == harness.fresh_greedy(core.backend, harness.PROMPTS, [MAX_TOKENS] * len(tokens))


def test_drain_with_staging_drains_after_the_transfer(core: engine.Engine, backend: ServingWhileStaging) -> None:
    status, tokens, running = asyncio.run(refit_while_running(core, staged("drain")))

    assert status.phase == "succeeded", status.error
    assert backend.tokens_while_staging >= TOKENS_WHILE_STAGING  # the transfer overlapped generation
    assert status.in_flight is not None and status.in_flight.drained == len(tokens)
    assert all(running.spans(index) == (Span(0, 0),) for index in range(len(tokens)))
    assert [name for name, _ in status.phases] == ["suspend", "apply", "switch"]
    pause = status.pause
    assert pause is not None and pause.gate_closed_seconds >= pause.stall_seconds >= pause.switch_seconds > 0
    assert (core.state, core.weight_version) == ("ready", 1)


def test_required_staging_without_a_copy_fails_and_touches_nothing(
    core: engine.Engine, backend: ServingWhileStaging
) -> None:
    core.staging = refit_staging.OFF
    status, tokens, running = asyncio.run(refit_while_running(core, staged("keep", staging="required")))

    assert status.phase == "failed"
    assert status.error == f"StagingUnavailable: staging is required, but {refit_staging.OFF.reason}"
    assert all(running.spans(index) == (Span(0, 0),) for index in range(len(tokens)))
    assert (core.state, core.weight_version, backend.tokens_while_staging) == ("ready", 0, 0)
