"""Prometheus metrics of one engine process, served on the metrics port (``GET /metrics``).

:class:`Metrics` owns its own registry (so several engines can live in one test process) and lives
with the engine (in the engine core process). It is fed by the frontend through
:class:`FrontendMetrics` (the :class:`RequestMetrics` middleware: requests, latency; serving: prompt
tokens, time to first token), directly in process or forwarded by the API-server processes
(:mod:`megafleet_engine.core_ipc`), and by the refit code (:meth:`Metrics.observe_refit`,
:meth:`Metrics.observe_refit_stall`); queue depth, waiting and running sequences, KV-cache use,
generated tokens, the sequences refits kept and the tokens they recomputed, the prompt tokens the
backend's prefix cache saved (:class:`~megafleet_engine.backends.base.CachesPrefixes`), weight version
and engine state are read from the engine at scrape time. :func:`build_app` is called by
:mod:`megafleet_engine.server`.

Names follow Prometheus's conventions (``megafleet_`` prefix, base units, ``_total`` counters,
``_ratio`` for 0..1): tokens per second is ``rate(megafleet_generated_tokens_total[1m])``, not a
gauge, and the prefix cache's hit rate over a window is
``rate(megafleet_prefix_cache_hit_tokens_total[1m]) / rate(megafleet_prefix_cache_prompt_tokens_total[1m])``
(``megafleet_prefix_cache_hit_ratio`` is the same since the engine started). What an autoscaler
reads (docs/autoscaling.md): ``megafleet_waiting_sequences`` and
``megafleet_running_sequences`` per pod, summed per fleet by the ``fleet`` label Prometheus adds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import fastapi
import prometheus_client
from fastapi import responses
from prometheus_client import core, registry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from megafleet_engine.backends import base

if TYPE_CHECKING:
    from megafleet_engine import engine as engine_module

__all__ = ["FrontendMetrics", "Metrics", "RequestMetrics", "build_app"]

STATES = ("loading", "ready", "suspended", "stale", "failed")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Request latency and time to first token, in seconds: from a cached token to a long generation."""
REFIT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Refit duration, in seconds: from a tiny CPU model to a large model over the network."""
STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""A refit's stall, in seconds: a staged switch (milliseconds) to an in-place drain (up to minutes)."""


class FrontendMetrics(Protocol):
    """What the OpenAI frontend records, wherever it runs."""

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None: ...

    def observe_first_token(self, seconds: float) -> None: ...

    def count_prompt_tokens(self, count: int) -> None: ...


class Metrics:
    """The metric families of one engine process (:class:`FrontendMetrics` included)."""

    def __init__(self, engine: engine_module.Engine, *, max_sequence_length: int | None = None) -> None:
        """``max_sequence_length`` sizes the KV-cache capacity (times the engine's batch size);
        without it ``megafleet_kv_cache_usage_ratio`` is not exported."""
        self.registry = registry.CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "megafleet_requests",
            "HTTP requests to the OpenAI frontend by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.request_latency = prometheus_client.Histogram(
            "megafleet_request_duration_seconds",
            "Time from a frontend request's arrival to its last byte, by endpoint.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_token = prometheus_client.Histogram(
            "megafleet_time_to_first_token_seconds",
            "Time from submitting a generation request to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = prometheus_client.Counter(
            "megafleet_prompt_tokens", "Prompt tokens of accepted requests.", registry=self.registry
        )
        self.refit_duration = prometheus_client.Histogram(
            "megafleet_refit_duration_seconds",
            "Duration of refits (suspend to resume) that this engine took part in.",
            ["outcome"],
            buckets=REFIT_BUCKETS,
            registry=self.registry,
        )
        self.refit_stall = prometheus_client.Histogram(
            "megafleet_refit_stall_seconds",
            "How long a successful refit kept this engine from generating: from its last step before "
            "the refit to its first after (a drain's wait excluded; the switch and any recompute included).",
            buckets=STALL_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine, max_sequence_length))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.request_latency.labels(endpoint=endpoint).observe(seconds)

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def count_prompt_tokens(self, count: int) -> None:
        self.prompt_tokens.inc(count)

    def observe_refit(self, duration_seconds: float, *, succeeded: bool) -> None:
        """Record one refit; called by the refit code when a refit ends either way."""
        self.refit_duration.labels(outcome="succeeded" if succeeded else "failed").observe(duration_seconds)

    def observe_refit_stall(self, seconds: float) -> None:
        """Record how long one successful refit stalled generation; called by the refit code."""
        self.refit_stall.observe(seconds)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return prometheus_client.generate_latest(self.registry)


class _EngineCollector(registry.Collector):
    """Gauges read from the engine when Prometheus scrapes, so they are never stale."""

    def __init__(self, engine: engine_module.Engine, max_sequence_length: int | None) -> None:
        self._engine = engine
        self._capacity = None if max_sequence_length is None else max_sequence_length * engine.max_batch_size

    def collect(self) -> Iterator[core.Metric]:
        engine = self._engine
        yield core.GaugeMetricFamily(
            "megafleet_queue_depth", "Sequences accepted and not finished.", value=engine.queue_depth
        )
        yield core.GaugeMetricFamily(
            "megafleet_running_sequences", "Sequences in the running batch.", value=engine.running
        )
        yield core.GaugeMetricFamily(
            "megafleet_waiting_sequences",
            "Sequences accepted and not yet running, plus sequences held at the gate during a refit.",
            value=engine.waiting,
        )
        if self._capacity:
            yield core.GaugeMetricFamily(
                "megafleet_kv_cache_usage_ratio",
                "KV-cache tokens the running batch may hold (each sequence's prompt plus max_tokens) "
                "over the capacity, max batch size times max sequence length.",
                value=min(engine.reserved_tokens() / self._capacity, 1.0),
            )
        yield core.CounterMetricFamily(
            "megafleet_generated_tokens",
            "Tokens generated (counted by the engine core).",
            value=engine.generated_tokens,
        )
        yield core.CounterMetricFamily(
            "megafleet_refit_kept_sequences",
            "Sequences that went on across a refit's switch of the weights (in-flight mode keep).",
            value=engine.pauses.kept_sequences,
        )
        yield core.CounterMetricFamily(
            "megafleet_refit_recomputed_tokens",
            "Tokens whose KV cache a refit recomputed with the new weights (keep with kvCacheMode recompute).",
            value=engine.pauses.recomputed_tokens,
        )
        yield from _prefix_cache(engine.backend)
        version = core.GaugeMetricFamily(
            "megafleet_weight_version", "Weight version served; absent until the first weights are loaded."
        )
        if engine.weight_version is not None:
            version.add_metric([], engine.weight_version)
        yield version
        state = core.GaugeMetricFamily("megafleet_engine_state", "1 for the engine's current state.", labels=["state"])
        for name in STATES:
            state.add_metric([name], 1.0 if engine.state == name else 0.0)
        yield state


def _prefix_cache(backend: object) -> Iterator[core.Metric]:
    """The prefix cache's counters, for a backend that has one (on or off)."""
    if not isinstance(backend, base.CachesPrefixes):
        return
    counters = backend.prefix_cache
    yield core.CounterMetricFamily(
        "megafleet_prefix_cache_prompt_tokens",
        "Prompt tokens of the sequences the backend prefilled (each sequence's whole prompt).",
        value=counters.prompt_tokens,
    )
    yield core.CounterMetricFamily(
        "megafleet_prefix_cache_hit_tokens",
        "Prompt tokens whose KV came from the prefix cache or a sibling's prefill instead of a forward.",
        value=counters.hit_tokens,
    )
    yield core.GaugeMetricFamily(
        "megafleet_prefix_cache_hit_ratio",
        "Hit tokens over prompt tokens since the engine started (0 before any prompt).",
        value=counters.hit_ratio,
    )


class RequestMetrics:
    """ASGI middleware counting frontend requests by endpoint and status and timing them to the last
    byte (streams included). Endpoints outside ``known`` count as ``other`` to bound label values.

    A request is recorded just before its last byte is sent (so an API server's forwarded count
    reaches the core before the client can see the response end), or when it fails."""

    def __init__(self, app: ASGIApp, *, metrics: FrontendMetrics, known: frozenset[str]) -> None:
        self._app = app
        self._metrics = metrics
        self._known = known

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self._known else "other"
        started = time.monotonic()
        status = 500  # unless a response starts
        recorded = False

        def observe() -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                self._metrics.observe_request(path, status, time.monotonic() - started)

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                observe()
            await send(message)

        try:
            await self._app(scope, receive, record)
        finally:
            observe()


def build_app(metrics: Metrics) -> fastapi.FastAPI:
    """The metrics server's app: ``GET /metrics`` only."""
    app = fastapi.FastAPI(title="megafleet engine metrics", docs_url=None, redoc_url=None, openapi_url=None)
    exposition: Callable[[], bytes] = metrics.exposition

    @app.get("/metrics")
    def scrape() -> responses.Response:
        return responses.Response(exposition(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return app
