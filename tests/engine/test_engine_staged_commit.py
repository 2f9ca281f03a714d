"""The two-phase commit on an engine in this process with the tiny CPU model: a staged refit whose
commit is the operator's reports ``staged`` and keeps serving the old version until the commit comes
(``RefitController.commit``, what ``POST /v1/refit/commit`` calls), then switches at a step boundary;
a repeated commit answers its status; a commit nobody waits for is refused; no commit within the
deadline plus the grace discards the staged copy and fails the attempt with nothing switched; an abort
while staged does the same; an attempt that receives in place cannot wait and switches on its own,
saying why.
"""

from __future__ import annotations

import asyncio
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
MAX_TOKENS = 48
FINISHED_SECONDS = 300.0  # a loaded 2-core machine runs the tiny model at a few steps per second

pytestmark = pytest.mark.slow  # each test runs the tiny model for a few hundred steps


class CountingDiscards(transformers_backend.TransformersBackend):
    """The tiny backend, counting the discards of its staging copy."""

    discarded = 0

    def discard_staged(self) -> None:
        self.discarded += 1


@pytest.fixture(scope="module")
def backend() -> CountingDiscards:
    model, tokenizer = tiny.build_tiny(harness.SOURCE)
    staging = CountingDiscards(model, tokenizer, name="tiny", max_sequence_length=harness.MAX_SEQUENCE_LENGTH)
    staging.prepare_staging()
    return staging


@pytest.fixture
def core(backend: CountingDiscards) -> Iterator[engine.Engine]:
    backend.load_checkpoint(harness.SOURCE)
    backend.discarded = 0
    the_engine = engine.Engine(backend, max_batch_size=16)
    the_engine.staging = refit_staging.StagingPlan("auto", bytes=backend.staging_bytes())
    yield the_engine
    the_engine.close()


def request(
    commit: vocabulary.CommitMode = "operator", *, timeout: float = 60, grace: float = 30
) -> checkpoint.CheckpointRequest:
    return checkpoint.CheckpointRequest(
        version=1,
        path=harness.NEW_SOURCE,
        timeout_seconds=timeout,
        suspend_mode="keep",
        kv_cache_mode="persist",
        staging="auto",
        commit=commit,
        commit_grace_seconds=grace,
    )


def live_weights(core: engine.Engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in core.backend.parameters().items()}


async def staged_while_running(
    core: engine.Engine, refits: refit_controller.RefitController, refit: checkpoint.CheckpointRequest
) -> harness.Together:
    """Eight sequences running as one batch, the refit started once each has a few tokens and
    waited for until it is staged."""
    running = await harness.Together.start(core, harness.PROMPTS, MAX_TOKENS)
    await harness.until(lambda: min(running.counts()) >= 5, "every sequence produced a few tokens")
    refits.start(refit, asyncio.get_running_loop())
    await harness.until(lambda: refits.snapshot().phase in ("staged", "failed"), "the refit staged", timeout=60)
    return running


def test_a_staged_refit_serves_the_old_version_until_the_operator_commits_then_switches(
    core: engine.Engine, backend: CountingDiscards
) -> None:
    refits = refit_controller.RefitController(core)

    async def scenario() -> tuple[list[list[int]], harness.Together, int, phases.Snapshot]:
        running = await staged_while_running(core, refits, request())
        before = sum(running.counts())
        await harness.until(lambda: sum(running.counts()) > before + 8, "tokens while staged", timeout=60)
        assert (refits.snapshot().phase, core.weight_version) == ("staged", 0), "switched before the commit"
        served_while_staged = sum(running.counts()) - before
        refits.commit(1)
        await harness.until(lambda: refits.snapshot().phase in ("succeeded", "failed"), "the outcome", timeout=60)
        again = refits.commit(1)  # the operator pushes again after a restart: answered, not rerun
        return await running.finished(FINISHED_SECONDS), running, served_while_staged, again

    tokens, running, served_while_staged, again = asyncio.run(scenario())

    status = refits.snapshot()
    assert status.phase == "succeeded", status.error
    assert again.phase == "succeeded"
    assert served_while_staged > 8
    assert status.commit == phases.Commit(requested="operator", effective="operator", committed=True)
    switched = [running.spans(index) for index in range(len(tokens)) if len(running.spans(index)) == 2]
    assert switched, "no sequence was still running at the commit"
    for first, second in switched:
        assert first == Span(0, 0) and second.version == 1
    new = tiny.reference_weights(harness.NEW_SOURCE)
    for name, tensor in backend.parameters().items():
        assert torch.equal(tensor, new[name]), name
    assert (core.state, core.weight_version, backend.discarded) == ("ready", 1, 0)


def test_a_commit_no_attempt_waits_for_is_refused(core: engine.Engine) -> None:
    refits = refit_controller.RefitController(core)
    with pytest.raises(refit_controller.NotStaged, match="no refit ran"):
        refits.commit(1)

    async def scenario() -> None:
        await staged_while_running(core, refits, request())
        with pytest.raises(refit_controller.NotStaged, match="version 1"):
            refits.commit(2)
        refits.abort("the test is over")

    asyncio.run(scenario())
    with pytest.raises(refit_controller.NotStaged, match="failed"):
        refits.commit(1)


def test_no_commit_within_the_deadline_plus_the_grace_discards_the_staged_copy(
    core: engine.Engine, backend: CountingDiscards
) -> None:
    refits = refit_controller.RefitController(core)
    before = live_weights(core)

    async def scenario() -> list[list[int]]:
        running = await staged_while_running(core, refits, request(timeout=10.0, grace=1.0))
        await harness.until(lambda: refits.snapshot().phase == "failed", "the commit's expiry", timeout=60)
        # The attempt's thread discards the copy once the failure is recorded (the status says failed
        # first): awaited, not assumed, so that a loaded machine cannot race the count below.
        await harness.until(lambda: backend.discarded > 0, "the staged copy discarded", timeout=60)
        return await running.finished(FINISHED_SECONDS)

    tokens = asyncio.run(scenario())

    status = refits.snapshot()
    assert status.phase == "failed" and (status.error or "").startswith("CommitExpired: no operator commit came")
    assert "timeoutSeconds=10 plus commitGraceSeconds=1" in (status.error or "")
    assert status.timed_out and status.commit is not None and status.commit.expired and not status.commit.committed
    assert status.pause is None, "no pause ever happened"
    assert backend.discarded == 1
    assert (core.state, core.weight_version, core.paused) == ("ready", 0, False)
    for name, tensor in backend.parameters().items():
        assert torch.equal(tensor, before[name]), f"{name} changed although nothing was committed"
    assert tokens == harness.fresh_greedy(core.backend, harness.PROMPTS, [MAX_TOKENS] * len(tokens))


def test_an_abort_while_staged_discards_the_copy_and_serves_on(core: engine.Engine, backend: CountingDiscards) -> None:
    refits = refit_controller.RefitController(core)

    async def scenario() -> list[list[int]]:
        running = await staged_while_running(core, refits, request())
        refits.abort("another member failed: bucket 3 did not match its digest")
        return await running.finished(FINISHED_SECONDS)

    tokens = asyncio.run(scenario())

    status = refits.snapshot()
    assert status.phase == "failed" and "another member failed" in (status.error or "")
    assert refits.wait_settled(10)
    assert backend.discarded == 1
    assert (core.state, core.weight_version) == ("ready", 0)
    assert tokens == harness.fresh_greedy(core.backend, harness.PROMPTS, [MAX_TOKENS] * len(tokens))


def test_an_in_place_refit_cannot_wait_for_a_commit_and_switches_on_its_own(core: engine.Engine) -> None:
    core.staging = refit_staging.OFF
    refits = refit_controller.RefitController(core)

    async def scenario() -> None:
        running = await harness.Together.start(core, harness.PROMPTS, 16)
        refits.start(request(), asyncio.get_running_loop())
        await harness.until(lambda: refits.snapshot().phase in ("succeeded", "failed"), "the outcome", timeout=60)
        await running.finished(FINISHED_SECONDS)

    asyncio.run(scenario())

    status = refits.snapshot()
    assert status.phase == "succeeded", status.error
    assert status.commit is not None and (status.commit.requested, status.commit.effective) == ("operator", "local")
    assert "receives in place and cannot wait for a commit" in (status.commit.reason or "")
    assert refits.commit(1).phase == "succeeded"  # an operator's commit afterwards: already switched
    assert (core.state, core.weight_version) == ("ready", 1)
