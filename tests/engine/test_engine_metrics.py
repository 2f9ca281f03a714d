"""The Prometheus endpoint: counters and histograms move with the requests the frontend served, and
the gauges read the engine's state at scrape time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from prometheus_client import parser

from helpers import engine_harness as harness
from megafleet_engine import engine, metrics
from megafleet_engine.backends import base
from megafleet_protocol import vocabulary


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.Served]:
    """A ready engine serving weight version 0, no API key."""
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path)) as running:
        yield running


def _scrape(served: harness.Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(f"{served.metrics_url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in parser.text_string_to_metric_families(response.text)
        for sample in family.samples
    }


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_metrics_count_requests_tokens_and_read_engine_state(served: harness.Served) -> None:
    with served.openai_client() as client:
        completion = client.completions.create(model=harness.MODEL, prompt="hello", max_tokens=5, temperature=0)
        chat = client.chat.completions.create(
            model=harness.MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
        )
    with served.http() as http:
        assert http.post("/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404
    served.metrics.observe_refit(2.0, succeeded=True)
    assert completion.usage is not None and chat.usage is not None

    samples = _scrape(served)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("megafleet_requests_total", endpoint="/v1/completions", status="200") == 1
    assert value("megafleet_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert value("megafleet_requests_total", endpoint="/v1/completions", status="404") == 1
    assert value("megafleet_prompt_tokens_total") == completion.usage.prompt_tokens + chat.usage.prompt_tokens
    assert value("megafleet_generated_tokens_total") == (
        completion.usage.completion_tokens + chat.usage.completion_tokens
    )
    assert value("megafleet_time_to_first_token_seconds_count") == 2
    assert value("megafleet_request_duration_seconds_count", endpoint="/v1/completions") == 2
    assert value("megafleet_refit_duration_seconds_count", outcome="succeeded") == 1
    assert value("megafleet_queue_depth") == 0
    assert value("megafleet_weight_version") == 0
    assert value("megafleet_engine_state", state="ready") == 1
    assert value("megafleet_engine_state", state="suspended") == 0

    with served.agent() as agent:
        agent.post("/v1/suspend", json={"mode": "drain", "timeoutSeconds": 5})
        agent.post("/v1/resume", json={"weightVersion": 4})
        agent.post("/v1/suspend", json={"mode": "drain", "timeoutSeconds": 5})
    after = _scrape(served)
    assert after[("megafleet_weight_version", ())] == 4
    assert after[("megafleet_engine_state", (("state", "suspended"),))] == 1


class _HeldBackend(base.InPlaceOnly):
    """A backend double that holds its batch until the test lets it go, then gives each sequence
    one token: what is queued meanwhile waits (no continuous batching)."""

    supports_admission = False
    kv_cache_mode: vocabulary.KvCacheMode = "offload"
    tokenizer = None
    follows = False
    spans_ranks = False

    def __init__(self) -> None:
        self.info = base.ModelInfo(name="double", max_sequence_length=64, vocab_size=100, eos_token_id=None)
        self.release = threading.Event()

    def generate(self, batch: Sequence[base.SequenceRequest], admit: object = None) -> Iterator[list[base.TokenStep]]:
        self.release.wait(30)
        yield [base.TokenStep(request.request_id, 7, None, finish_reason="length") for request in batch]

    def close(self) -> None:
        self.release.set()


def test_waiting_sequences_and_kv_cache_use_are_read_from_the_engine_at_scrape_time() -> None:
    double = _HeldBackend()
    core = engine.Engine(double, max_batch_size=2)  # type: ignore[arg-type]
    scraped = metrics.Metrics(core, max_sequence_length=64)

    def sample(name: str) -> float:
        families = parser.text_string_to_metric_families(scraped.exposition().decode())
        return next(s.value for f in families for s in f.samples if s.name == name)

    async def scenario() -> tuple[float, float, float]:
        requests = [
            base.SequenceRequest(f"r{i}", (1, 2, 3), base.SamplingParams(max_tokens=13, temperature=0.0))
            for i in range(5)
        ]

        async def run(request: base.SequenceRequest) -> list[int]:
            return [step.token_id async for step in core.submit(request)]

        tasks = [asyncio.ensure_future(run(request)) for request in requests]
        for _ in range(5000):
            if core.running == 2 and core.queue_depth == 5:
                break
            await asyncio.sleep(0.002)
        seen = sample("megafleet_running_sequences"), sample("megafleet_waiting_sequences")
        kv = sample("megafleet_kv_cache_usage_ratio")
        double.release.set()
        assert [await task for task in tasks] == [[7]] * 5
        return seen[0], seen[1], kv

    try:
        running, waiting, kv = asyncio.run(scenario())
    finally:
        double.close()
        core.close()
    assert (running, waiting) == (2, 3)
    assert kv == pytest.approx(2 * (3 + 13) / (2 * 64))  # two running sequences' prompt + max_tokens
    assert sample("megafleet_waiting_sequences") == 0 and sample("megafleet_kv_cache_usage_ratio") == 0
