"""The Prometheus endpoint: counters and histograms move with the requests the frontend served, and
the gauges read the engine's state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import parser

from helpers import engine_harness as harness


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
