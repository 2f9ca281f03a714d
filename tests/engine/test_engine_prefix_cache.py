"""Prefix sharing in the transformers backend on the tiny CPU model: the samples of one prompt are
prefilled once, and with it on or off the tokens are equal (greedy, and seeded sampling) at several
batch sizes; after a refit in every mode (drained, aborted, kept with persist or recompute, staged)
a new batch of siblings gives a fresh engine's greedy tokens at the new version; the engine exports
the hit counts for Prometheus; an OpenAI client's ``n`` samples of one prompt share one prefill.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import parser

from helpers import engine_harness
from helpers import keep_harness as harness
from megafleet_engine import engine, metrics, refit_staging
from megafleet_engine.backends import base, transformers_backend
from megafleet_engine.models import tiny
from megafleet_engine.refit_attempts import controller as refit_controller
from megafleet_engine.refit_attempts.sources import checkpoint
from megafleet_protocol import vocabulary

MAX_TOKENS = 24


def backend_with(prefix_caching: bool, source: str = harness.SOURCE) -> transformers_backend.TransformersBackend:
    model, tokenizer = tiny.build_tiny(source)
    return transformers_backend.TransformersBackend(
        model, tokenizer, name="tiny", max_sequence_length=harness.MAX_SEQUENCE_LENGTH, prefix_caching=prefix_caching
    )


def siblings(prompts: int, samples: int) -> list[list[int]]:
    """``samples`` copies of each of the first ``prompts`` prompts, interleaved as a router may send them."""
    return [list(harness.PROMPTS[index % prompts]) for index in range(prompts * samples)]


def run(
    backend: base.Backend, prefixes: list[list[int]], *, temperature: float = 0.0, seed: int | None = None
) -> list[list[int]]:
    """The tokens ``backend`` generates for ``prefixes`` as one batch (seeded per sequence when sampling)."""
    requests = [
        base.SequenceRequest(
            f"r{index}",
            tuple(prefix),
            base.SamplingParams(
                max_tokens=MAX_TOKENS,
                temperature=temperature,
                seed=None if seed is None else seed + index,
                ignore_eos=True,
            ),
        )
        for index, prefix in enumerate(prefixes)
    ]
    out: dict[str, list[int]] = {request.request_id: [] for request in requests}
    for steps in backend.generate(requests):
        for step in steps:
            out[step.request_id].append(step.token_id)
    return [out[request.request_id] for request in requests]


@pytest.mark.parametrize(("prompts", "samples"), [(1, 1), (1, 8), (2, 3), (4, 4), (8, 2), (3, 16)])
def test_siblings_prefill_once_and_the_tokens_equal_prefilling_each(prompts: int, samples: int) -> None:
    shared, alone = backend_with(True), backend_with(False)
    batch = siblings(prompts, samples)
    assert run(shared, batch) == run(alone, batch)
    assert run(shared, batch, temperature=1.0, seed=5) == run(alone, batch, temperature=1.0, seed=5)
    prompt_tokens = 2 * sum(len(prefix) for prefix in batch)
    unique_tokens = 2 * sum(len(prefix) for prefix in {tuple(prefix) for prefix in batch})
    assert shared.prefix_cache == base.PrefixCacheCounters(prompt_tokens, prompt_tokens - unique_tokens)
    assert alone.prefix_cache == base.PrefixCacheCounters(prompt_tokens, 0)
    assert isinstance(shared, base.CachesPrefixes)


@pytest.fixture
def core() -> Iterator[engine.Engine]:
    backend = backend_with(True)
    backend.prepare_staging()
    the_engine = engine.Engine(backend, max_batch_size=32)
    the_engine.staging = refit_staging.StagingPlan("auto", bytes=backend.staging_bytes())
    yield the_engine
    the_engine.close()


REFITS: list[tuple[vocabulary.InFlightMode, vocabulary.KvCacheMode, vocabulary.StagingMode]] = [
    ("drain", "persist", "off"),
    ("abort", "recompute", "off"),
    ("keep", "persist", "off"),
    ("keep", "recompute", "off"),
    ("keep", "persist", "auto"),
    ("drain", "persist", "auto"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("in_flight", "kv_cache_mode", "staging"), REFITS)
def test_after_a_refit_siblings_get_a_fresh_engines_greedy_tokens_at_the_new_version(
    core: engine.Engine,
    in_flight: vocabulary.InFlightMode,
    kv_cache_mode: vocabulary.KvCacheMode,
    staging: vocabulary.StagingMode,
) -> None:
    batch = siblings(4, 4)
    request = checkpoint.CheckpointRequest(
        version=1,
        path=harness.NEW_SOURCE,
        timeout_seconds=60,
        suspend_mode=in_flight,
        kv_cache_mode=kv_cache_mode,
        staging=staging,
    )

    async def scenario() -> list[list[int]]:
        running = await harness.Together.start(core, batch, 3 * MAX_TOKENS)
        await harness.until(lambda: min(running.counts()) >= 3, "every sequence produced a few tokens")
        refits = refit_controller.RefitController(core)
        refits.start(request, asyncio.get_running_loop())
        await harness.until(lambda: refits.snapshot().phase in ("succeeded", "failed"), "the refit's outcome")
        assert refits.snapshot().phase == "succeeded", refits.snapshot().error
        if in_flight != "abort":
            await running.finished()
        after = await harness.Together.start(core, batch, MAX_TOKENS)
        return await after.finished()

    tokens = asyncio.run(scenario())
    assert core.weight_version == 1
    assert tokens == run(backend_with(False, harness.NEW_SOURCE), batch)
    samples = {
        sample.name: sample.value
        for family in parser.text_string_to_metric_families(metrics.Metrics(core).exposition().decode())
        for sample in family.samples
    }
    assert samples["megafleet_prefix_cache_hit_tokens_total"] > 0
    assert samples["megafleet_prefix_cache_prompt_tokens_total"] >= 2 * sum(len(prefix) for prefix in batch)
    assert 0 < samples["megafleet_prefix_cache_hit_ratio"] < 1


@pytest.mark.slow
def test_an_openai_request_with_n_samples_is_prefilled_once(tmp_path: Path) -> None:
    backend = backend_with(True)
    prompt = list(harness.PROMPTS[5])
    with engine_harness.serve(backend, engine_harness.token_file(tmp_path)) as served, served.openai_client() as client:
        answer = client.completions.create(
            model=engine_harness.MODEL, prompt=prompt, n=4, max_tokens=5, temperature=1.0, seed=3
        )
        scraped = {
            sample.name: sample.value
            for family in parser.text_string_to_metric_families(served.metrics.exposition().decode())
            for sample in family.samples
        }
    assert len(answer.choices) == 4
    assert backend.prefix_cache == base.PrefixCacheCounters(4 * len(prompt), 3 * len(prompt))
    assert scraped["megafleet_prefix_cache_hit_ratio"] == 0.75
