"""No failed requests around a refit, and versions never go backwards
(docs/architecture.md#what-every-refit-shares), against the real control plane, the operator and
engine pods run by the local runner.

A trainer refits a two-shard tiny fleet that drains (``inFlight: drain``; staging at its default,
auto) 20 times in a row through the SDK (each version other weights: a seed whose greedy output
differs from every other version's, sent over gloo with a sender kept open). Meanwhile threads
hammer every frontend directly (pod IPs, no retries) and a second SDK
:class:`~megafleet.sdk.fleet.Fleet` (another client, routing from the fleet's status it re-reads
before every request) generates too. Every answer must come back (no 503: a request that
reaches a suspended engine waits and is served by the new version) and its tokens must be the
greedy continuation of exactly the version stamped on it. Then two Refits that would go backwards
(the current version, an older one) fail at once with reason ``VersionNotNewer`` while the fleet
keeps serving its version.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
from pathlib import Path

import httpx
import torch

from helpers import refit_e2e
from megafleet.api import v1alpha1
from megafleet.sdk import errors, fleet, generation, weights
from megafleet_dev import kube
from megafleet_engine.models import tiny

log = logging.getLogger(__name__)

VERSIONS = 20
MAX_TOKENS = 12
TRAINER_ADDRESS = "127.0.9.4"
THREADS_PER_FRONTEND = 2
AFTER_LAST_REFIT = 10  # requests the second client makes after the last refit succeeded


def versions() -> tuple[dict[int, torch.nn.Module], dict[int, list[int]]]:
    """The weights of version 0 (the fleet's own) to ``VERSIONS``, each a seed whose greedy output
    differs from every earlier version's (some seeds end at once on EOS: skipped), and that output."""
    models: dict[int, torch.nn.Module] = {0: tiny.build_tiny("tiny://llama")[0]}
    expected = {0: greedy(models[0])}
    seed = 100
    while len(models) <= VERSIONS:
        seed += 1
        model = tiny.build_tiny(f"tiny://llama?seed={seed}")[0]
        tokens = greedy(model)
        if len(tokens) == MAX_TOKENS and tokens not in expected.values():
            models[len(models)], expected[len(expected)] = model, tokens
    return models, expected


def greedy(model: torch.nn.Module) -> list[int]:
    inputs = torch.tensor([refit_e2e.PROMPT])
    with torch.inference_mode():
        output = model.generate(  # type: ignore[operator]
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=MAX_TOKENS
        )
    return [int(token) for token in output[0, len(refit_e2e.PROMPT) :]]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((TRAINER_ADDRESS, 0))
        return int(probe.getsockname()[1])


class Tally:
    """What the clients saw, shared by the hammer threads and the second client (under a lock)."""

    def __init__(self, expected: dict[int, list[int]]) -> None:
        self.expected = expected
        self.lock = threading.Lock()
        self.served: collections.Counter[int] = collections.Counter()
        self.errors: list[str] = []
        self.mixed: list[str] = []

    def answer(self, who: str, version: int | None, tokens: list[int]) -> None:
        with self.lock:
            if version is None or tokens != self.expected.get(version):
                self.mixed.append(f"{who}: version {version} answered {tokens}")
            else:
                self.served[version] += 1

    def error(self, who: str, what: str) -> None:
        with self.lock:
            self.errors.append(f"{who}: {what}")


def hammer(url: str, tally: Tally, stop: threading.Event) -> None:
    """Greedy completions on one frontend until ``stop``; every failure counts (no retries)."""
    body = {
        "model": "tiny",
        "prompt": refit_e2e.PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            try:
                response = client.post(f"{url}/completions", json=body)
            except httpx.HTTPError as error:
                tally.error(url, f"{type(error).__name__}: {error}")
                continue
            if response.status_code != 200:
                tally.error(url, f"HTTP {response.status_code}: {response.text[:200]}")
                continue
            answer = response.json()
            tally.answer(url, answer.get("weight_version"), [int(t) for t in answer["choices"][0]["token_ids"]])


async def second_client(namespace: str, kubeconfig: Path, tally: Tally, done: asyncio.Event, after: list[int]) -> None:
    """Another process's client: re-reads the fleet's status before every request."""
    sampling = generation.Sampling(max_tokens=MAX_TOKENS, temperature=0, logprobs=False)
    async with fleet.Fleet("tiny", namespace, kubeconfig=kubeconfig, addressing="pod") as other:
        await other.wait_ready(timeout=refit_e2e.WAIT)
        while not done.is_set() or after[0] < AFTER_LAST_REFIT:
            if done.is_set():
                after[0] += 1
            try:
                await other.refresh()
                answer = await other.complete(refit_e2e.PROMPT, sampling)
            except (errors.NoFrontend, errors.GenerationFailed) as error:
                tally.error("second client", f"{type(error).__name__}: {error}")
                continue
            tally.answer("second client", answer.weight_version, answer.token_ids)


def test_clients_see_no_error_and_no_mixed_answer_across_20_refits_and_stale_refits_are_refused(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path
) -> None:
    models, expected = versions()
    # drain: no answer spans two versions (keep, the default, would continue them on the new weights)
    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet(refit={"inFlight": "drain"}))
    assert kube_admin.wait(f"{refit_e2e.fleets(namespace)}/tiny", refit_e2e.ready, timeout=refit_e2e.WAIT)
    urls = []
    for pod in ("tiny-s0-p0", "tiny-s1-p0"):
        found = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
        assert found is not None
        urls.append(f"http://{found['status']['podIP']}:8000/v1")

    tally = Tally(expected)
    stop = threading.Event()
    threads = [
        threading.Thread(target=hammer, args=(url, tally, stop), daemon=True)
        for url in urls
        for _ in range(THREADS_PER_FRONTEND)
    ]
    for thread in threads:
        thread.start()
    current = [models[0]]
    send = weights.Sender(lambda: current[0].named_parameters(), keep_open=True, timeout_seconds=60)
    port = free_port()
    refused: list[errors.RefitFailed] = []

    async def scenario() -> None:
        done, after = asyncio.Event(), [0]
        other = asyncio.ensure_future(second_client(namespace, kubeconfig, tally, done, after))
        try:
            async with fleet.Fleet("tiny", namespace, kubeconfig=kubeconfig, addressing="pod") as trainer:
                await trainer.wait_ready(timeout=refit_e2e.WAIT)
                rendezvous = v1alpha1.RendezvousSource(address=TRAINER_ADDRESS, port=port)
                for version in range(1, VERSIONS + 1):
                    current[0] = models[version]
                    result = await trainer.refit(version, rendezvous=rendezvous, send=send, timeout=refit_e2e.WAIT)
                    assert result.members == (0, 1)
                for stale in (VERSIONS, 3):  # the current version again, then an older one
                    try:
                        await trainer.refit(stale, rendezvous=rendezvous, send=send, timeout=refit_e2e.WAIT)
                    except errors.RefitFailed as failed:
                        refused.append(failed)
                done.set()
                await asyncio.wait_for(other, refit_e2e.WAIT)
        finally:
            done.set()
            other.cancel()
            send.close()

    try:
        asyncio.run(scenario())
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=refit_e2e.WAIT)

    log.warning(  # shown in pytest's report ("Captured log call") and with -o log_cli=true
        "refit continuity: %d answers over %d refits (by version %s), %d errors, %d mixed",
        sum(tally.served.values()),
        VERSIONS,
        dict(sorted(tally.served.items())),
        len(tally.errors),
        len(tally.mixed),
    )
    assert not tally.errors, tally.errors[:5]
    assert not tally.mixed, tally.mixed[:5]
    assert tally.served[VERSIONS] > 0 and len(tally.served) > VERSIONS // 2  # the clients saw the refits go by

    assert len(refused) == 2, "a Refit that would go backwards must fail"
    for failed in refused:
        assert failed.status is not None and failed.status.phase == "Failed"
        [condition] = [c for c in failed.status.conditions if c.type == "Failed"]
        assert condition.reason == "VersionNotNewer" and f"current version {VERSIONS}" in condition.message
    fleet_now = kube_admin.get(f"{refit_e2e.fleets(namespace)}/tiny")
    assert fleet_now is not None and fleet_now["status"]["refit"]["currentVersion"] == VERSIONS
    for shard in fleet_now["status"]["shards"]:
        tokens, version = refit_e2e.served(kube_admin, namespace, shard["pods"][0])
        assert (tokens, version) == (expected[VERSIONS], str(VERSIONS))
