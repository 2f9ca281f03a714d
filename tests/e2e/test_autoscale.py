"""Fleet autoscaling end to end (docs/autoscaling.md), with the real components: Prometheus scrapes every
engine pod (Kubernetes service discovery against the local API server), KEDA's operator and
metrics API server feed the HPA controller of kube-controller-manager, and the HPA writes the
fleet's ``/scale``. The ScaledObject is the chart's (``autoscaling.fleets``), rendered by helm.

A client (the official ``openai`` client, one thread per concurrent request) routes to the shards
the fleet's status lists as serving; its load raises the sequences the engines hold, KEDA/HPA scale
the fleet 1 -> 3, the new shards load the checkpoint of the refit made earlier before they serve,
and once the load stops the fleet is scaled back to 1 with drain: no request the engines accepted
fails. A second test shows the interlock: a scale decision taken while a refit runs places nothing
until the refit has ended.

Its own tier (marker ``autoscale``; ``pytest -m autoscale tests/e2e/test_autoscale.py``): Prometheus
and KEDA are built on first use (docs/autoscaling.md#cold-builds-of-prometheus-and-keda gives the cold
build time). Timings go to
``$MEGAFLEET_AUTOSCALE_RESULTS`` (JSON) when set.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers import autoscale_e2e as scaling
from helpers import refit_e2e as base
from megafleet.objects import Object
from megafleet_dev import autoscale, kube
from megafleet_protocol import ports
from megafleet_protocol.refit import sender as sdk

pytestmark = [pytest.mark.autoscale, pytest.mark.timeout(600)]

FLEET = "tiny"
WAIT = 180
CHECKPOINT = "tiny://llama?seed=7"  # version 1's weights, loaded as a checkpoint
MAX_BATCH = 4
WORKERS = 12  # concurrent requests of the load: three shards' worth at SEQUENCES_PER_SHARD
TRICKLE = 2  # concurrent requests while the fleet scales down: one shard's worth
TRICKLE_MAX_TOKENS = 192
"""The trickle's requests are long and go to the serving shard a scale-in removes first (the highest
index), so the drain of each removed shard has requests to finish, whatever the operator's reaction
time and however many shards one HPA step removes."""
MAX_TOKENS = 48
# The chart values of the ScaledObject (autoscaling.*): short windows to keep the test short.
SETTINGS = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "sequencesPerShard": MAX_BATCH,
    "pollingInterval": 2,
    "cooldownPeriod": 30,
    "scaleDownStabilizationSeconds": 5,
    "scaleUpShardsPer15s": 2,
}
SERVING = ("Ready", "Refitting")  # a refitting shard holds requests at its gate for the new version


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {
        "settings": {
            **SETTINGS,
            "scrapeIntervalSeconds": scaling.SCRAPE_SECONDS,
            "hpaSyncPeriodSeconds": scaling.HPA_SYNC_SECONDS,
        },
        "load": {"workers": WORKERS, "trickle": TRICKLE, "maxTokens": MAX_TOKENS, "maxBatchSize": MAX_BATCH},
    }
    yield found
    target = os.environ.get("MEGAFLEET_AUTOSCALE_RESULTS")
    if target:
        Path(target).write_text(json.dumps(found, indent=2) + "\n")


def fleet_path(namespace: str) -> str:
    return f"{base.fleets(namespace)}/{FLEET}"


def start_fleet(kube_admin: kube.Kube, namespace: str) -> None:
    manifest = base.tiny_fleet(replicas=1, weights={"catchUp": "checkpoint"})  # new shards load the checkpoint
    manifest["spec"]["engine"]["maxBatchSize"] = MAX_BATCH
    kube_admin.create(base.fleets(namespace), manifest)
    assert kube_admin.wait(fleet_path(namespace), base.ready, timeout=WAIT, what="one shard Ready") is not None


def checkpoint_refit(kube_admin: kube.Kube, namespace: str, version: int, path: str) -> None:
    refit = base.create_refit(kube_admin, namespace, FLEET, version, checkpoint=path)
    done = kube_admin.wait(refit, base.refit_ended, timeout=WAIT, what="the checkpoint refit")
    assert done is not None and done["status"]["phase"] == "Succeeded", (done or {}).get("status")


# -- the client ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Result:
    shard: int
    started: float
    ended: float
    outcome: str  # ok | refused (never accepted: the gate said 503, or nothing listened) | failed
    version: str = ""
    detail: str = ""


class Client:
    """Workers sending completions to the shards the fleet's status lists as serving, round robin
    (or, with ``aim_last``, to the serving shard of highest index), each request once to one shard; a
    refused request is tried again on the next shard."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.namespace = namespace
        self.results: list[Result] = []
        self.max_tokens = MAX_TOKENS  # of the requests sent from now on
        self.aim_last = False  # of the requests sent from now on
        self._kube = kube.Kube.from_kubeconfig(kubeconfig)
        self._routes: list[tuple[int, str]] = []
        self._turn = itertools.count()
        self._stop_routes = threading.Event()
        self._router = threading.Thread(target=self._route, name="routes", daemon=True)
        self._workers: list[tuple[threading.Thread, threading.Event]] = []

    def __enter__(self) -> Client:
        self._router.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.scale(0)
        self._stop_routes.set()
        self._router.join(timeout=30)
        self._kube.close()

    def scale(self, workers: int) -> None:
        """Run ``workers`` concurrent requests from now on; extra workers are all told to stop at
        once and each ends after its request (waited for here)."""
        extra, self._workers = self._workers[workers:], self._workers[:workers]
        for _, stop in extra:
            stop.set()
        for thread, _ in extra:
            thread.join(timeout=120)
            assert not thread.is_alive(), "a request never ended"
        while len(self._workers) < workers:
            stop = threading.Event()
            thread = threading.Thread(target=self._work, args=(stop,), name=f"worker-{len(self._workers)}", daemon=True)
            self._workers.append((thread, stop))
            thread.start()

    def of(self, outcome: str, *, shards: set[int] | None = None, since: float = 0.0) -> list[Result]:
        return [
            r
            for r in list(self.results)
            if r.outcome == outcome and r.ended >= since and (shards is None or r.shard in shards)
        ]

    def _route(self) -> None:
        while not self._stop_routes.is_set():
            fleet = self._kube.get(fleet_path(self.namespace)) or {}
            pods = self._kube.list(f"/api/v1/namespaces/{self.namespace}/pods")["items"]
            ips = {pod["metadata"]["name"]: pod["status"].get("podIP") for pod in pods}
            routes = []
            for entry in (fleet.get("status") or {}).get("shards", []):
                ip = ips.get((entry.get("pods") or [""])[0])
                if entry.get("phase") in SERVING and ip:
                    routes.append((int(entry["index"]), f"http://{ip}:8000/v1"))
            self._routes = sorted(routes)
            self._stop_routes.wait(0.3)  # the status poll's pace, not synchronisation

    def _work(self, stop: threading.Event) -> None:
        clients: dict[str, openai.OpenAI] = {}
        try:
            while not stop.is_set():
                routes = self._routes
                if not routes:
                    stop.wait(0.2)  # nothing serves yet
                    continue
                shard, url = routes[-1] if self.aim_last else routes[next(self._turn) % len(routes)]
                # Kept-alive connections, as the client makes them: a draining shard closes each
                # connection after its response (Connection: close), and its stopping frontend
                # answers a request on one left idle since before the drain with 503 rather than
                # closing it under the request (the lame duck of megafleet_engine.http_server).
                client = clients.get(url) or clients.setdefault(
                    url, openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
                )
                self.results.append(self._ask(client, shard))
        finally:
            for client in clients.values():
                client.close()

    def _ask(self, client: openai.OpenAI, shard: int) -> Result:
        started = time.monotonic()
        try:
            raw = client.completions.with_raw_response.create(
                model=FLEET, prompt=base.PROMPT, max_tokens=self.max_tokens, temperature=0
            )
            raw.parse()
            version = raw.headers["X-Megafleet-Weight-Version"]
            return Result(shard, started, time.monotonic(), "ok", version=version)
        except openai.APIStatusError as error:
            outcome = "refused" if error.status_code == 503 else "failed"
            return Result(shard, started, time.monotonic(), outcome, detail=f"{error.status_code} {error.message}")
        except openai.APIConnectionError as error:
            # Nothing listening (a removed shard's process is gone) was never accepted; a
            # connection that broke after the request went out was.
            refused = isinstance(error.__cause__, httpx.ConnectError)
            outcome = "refused" if refused else "failed"
            return Result(shard, started, time.monotonic(), outcome, detail=repr(error.__cause__))


class Sampler:
    """Reads the fleet's waiting sequences from Prometheus twice a second, on its own thread."""

    def __init__(self, prometheus_url: str, namespace: str) -> None:
        self.samples: list[tuple[float, float]] = []
        self._url, self._namespace = prometheus_url, namespace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def most(self, until: float) -> float:
        return max((value for at, value in self.samples if at <= until), default=0.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(
                (time.monotonic(), scaling.metric(self._url, "megafleet_waiting_sequences", self._namespace, FLEET))
            )
            self._stop.wait(0.5)  # the sampling period


# -- the tests -----------------------------------------------------------------------------------


def test_load_scales_the_fleet_out_and_back_in_with_new_shards_caught_up_first(
    autoscaler: autoscale.Autoscale,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    namespace: str,
    results: dict[str, Any],
) -> None:
    start_fleet(kube_admin, namespace)
    checkpoint_refit(kube_admin, namespace, 1, CHECKPOINT)
    scaling.autoscale_fleet(kube_admin, namespace, autoscaler.prometheus_url, FLEET, SETTINGS)
    url = autoscaler.prometheus_url
    # Prometheus found the engine through the API server and labels it with its fleet and shard.
    scraped = autoscale.query(url, f'count(up{{namespace="{namespace}",fleet="{FLEET}",shard="0"}} == 1)')
    assert scraped == 1

    timeline: dict[str, float] = {}
    phases: dict[int, list[str]] = {1: [], 2: []}

    def watch(obj: Object | None) -> None:
        """Record the first time each thing is seen, and every phase the new shards pass through."""
        now = time.monotonic()
        spec, status = (obj or {}).get("spec", {}), (obj or {}).get("status", {})
        if spec.get("replicas", 1) > 1:
            timeline.setdefault("scaled_out", now)
        for entry in status.get("shards", []):
            trail = phases.get(int(entry["index"]))
            if trail is not None and (not trail or trail[-1] != entry.get("phase")):
                trail.append(entry.get("phase", ""))

    with Client(kubeconfig, namespace) as client, Sampler(url, namespace) as sampler:
        load_started = time.monotonic()
        client.scale(WORKERS)

        def three_serving(obj: Object | None) -> bool:
            watch(obj)
            return base.ready(obj) and (obj or {})["status"].get("readyReplicas") == 3

        fleet = kube_admin.wait(fleet_path(namespace), three_serving, timeout=WAIT, what="three shards Ready")
        assert fleet is not None and fleet["spec"]["replicas"] == 3
        three_ready = time.monotonic()
        deadline = time.monotonic() + WAIT
        while not client.of("ok", shards={1, 2}) and time.monotonic() < deadline:
            time.sleep(0.2)  # a request needs to finish on a new shard; the client's pace
        served_new = client.of("ok", shards={1, 2})
        assert served_new, "no request was served by a new shard"
        first_served = min(r.ended for r in served_new)

        # Load ends: a trickle of one shard's worth keeps requests in flight on the shard that is
        # removed next while the fleet scales back to one, drained shard by shard.
        load_ended = time.monotonic()
        client.scale(TRICKLE)  # the others end after their request
        client.max_tokens = TRICKLE_MAX_TOKENS
        client.aim_last = True

        def back_to_one(obj: Object | None) -> bool:
            now = time.monotonic()
            replicas = (obj or {}).get("spec", {}).get("replicas", 3)
            if replicas < 3:
                timeline.setdefault("scale_in_began", now)
            if replicas == 1:
                timeline.setdefault("scaled_in", now)
            status = (obj or {}).get("status", {})
            return "scaled_in" in timeline and status.get("replicas") == 1 and base.ready(obj)

        fleet = kube_admin.wait(fleet_path(namespace), back_to_one, timeout=WAIT, what="the fleet back at one shard")
        assert fleet is not None
        scaled_down = time.monotonic()
        client.scale(0)

    # The load raised the waiting sequences Prometheus read before the HPA scaled the fleet out.
    waiting = sampler.most(until=timeline["scaled_out"])
    assert waiting > 0, sampler.samples[:20]
    # The new shards started without weights and loaded version 1's checkpoint before they served.
    for shard, trail in phases.items():
        assert "Ready" in trail and "Stale" in trail and trail.index("Stale") < trail.index("Ready"), (shard, trail)
    assert {r.version for r in client.of("ok")} == {"1"}
    # No request the engines accepted failed: the removed shards drained what they held.
    assert client.of("failed") == [], client.of("failed")[:5]
    # Shard 2, removed first, had the trickle's requests in flight when its drain began; they ended
    # on it, served.
    assert client.of("ok", shards={2}, since=timeline["scale_in_began"]), "nothing was in flight during the drain"
    events = kube_admin.list(f"/api/v1/namespaces/{namespace}/events")["items"]
    removed = {e["message"] for e in events if e["reason"] == "ShardRemoved"}
    assert any("shard 2 drained" in m for m in removed) and any("shard 1 drained" in m for m in removed), removed

    results["scaleOut"] = {
        "loadStartToDecisionSeconds": round(timeline["scaled_out"] - load_started, 1),
        "loadStartToNewShardServingSeconds": round(first_served - load_started, 1),
        "loadStartToThreeReadySeconds": round(three_ready - load_started, 1),
        "maxWaitingSequencesBeforeDecision": waiting,
        "newShardPhases": {str(k): v for k, v in phases.items()},
    }
    results["scaleIn"] = {
        "loadEndToDecisionSeconds": round(timeline["scaled_in"] - load_ended, 1),
        "loadEndToOneShardSeconds": round(scaled_down - load_ended, 1),
        "requestsOk": len(client.of("ok")),
        "requestsRefusedAndRetried": len(client.of("refused")),
        "requestsFailed": len(client.of("failed")),
    }


def test_a_scale_decision_during_a_refit_places_nothing_until_the_refit_ended(
    autoscaler: autoscale.Autoscale,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    namespace: str,
    results: dict[str, Any],
) -> None:
    start_fleet(kube_admin, namespace)
    scaling.autoscale_fleet(kube_admin, namespace, autoscaler.prometheus_url, FLEET, SETTINGS)
    trainer = base.TrainerModel()
    port = base.free_port()
    name = f"{FLEET}-v1"
    refit = base.create_refit(kube_admin, namespace, FLEET, 1, port=port)
    running = kube_admin.wait(
        refit,
        lambda r: (r or {}).get("status", {}).get("phase") == "Running",
        timeout=WAIT,
        what="the refit Running (the trainer has not sent yet)",
    )
    assert running is not None

    with Client(kubeconfig, namespace) as client:
        client.scale(WORKERS)  # held at the gate of the refitting shard: waiting sequences rise

        def decided_and_seen(obj: Object | None) -> bool:
            spec, status = (obj or {}).get("spec", {}), (obj or {}).get("status", {})
            generation = (obj or {}).get("metadata", {}).get("generation")
            return bool(spec.get("replicas") == 3 and status.get("observedGeneration") == generation)

        # The HPA scaled the fleet to 3, and the operator has reconciled that spec, during the refit.
        fleet = kube_admin.wait(fleet_path(namespace), decided_and_seen, timeout=WAIT, what="the scale seen")
        assert fleet is not None
        decided = time.monotonic()
        assert fleet["status"]["refit"].get("active") == name
        pods = kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"]
        assert {pod["metadata"]["labels"]["megafleet.dev/shard"] for pod in pods} == {"0"}
        scaled_rv = int(fleet["metadata"]["resourceVersion"])

        # The trainer sends; the refit ends; only then are shards 1 and 2 placed.
        sender = sdk.WeightSender(
            ports.attempt_port(port, running["status"]["attempts"]),
            running["status"]["membership"]["worldSize"],
            address=base.TRAINER_ADDRESS,
            timeout_seconds=60,
        )
        try:
            sender.init()
            sender.send([(n, p.detach()) for n, p in trainer.model.named_parameters()], bucket_size_mib=1, version=1)
        finally:
            sender.close()
        done = kube_admin.wait(refit, base.refit_ended, timeout=WAIT)
        assert done is not None and done["status"]["phase"] == "Succeeded", (done or {}).get("status")
        refit_ended = time.monotonic()
        placed = kube_admin.wait(
            fleet_path(namespace),
            lambda o: len([s for s in (o or {}).get("status", {}).get("shards", []) if s.get("pods")]) == 3,
            timeout=WAIT,
            what="shards 1 and 2 placed",
        )
        assert placed is not None
        client.scale(0)

    history = kube_admin.history(f"/api/v1/namespaces/{namespace}/pods", since=str(scaled_rv))
    added = [e["object"] for e in history if e["type"] == "ADDED"]
    new_shards = {pod["metadata"]["labels"]["megafleet.dev/shard"] for pod in added}
    assert new_shards == {"1", "2"}, new_shards
    refit_history = kube_admin.history(f"{base.refits(namespace)}", since=str(scaled_rv))
    succeeded_rv = min(
        int(e["object"]["metadata"]["resourceVersion"])
        for e in refit_history
        if e["object"]["metadata"]["name"] == name and e["object"].get("status", {}).get("phase") == "Succeeded"
    )
    assert all(int(pod["metadata"]["resourceVersion"]) > succeeded_rv for pod in added)
    assert client.of("failed") == [], client.of("failed")[:5]
    assert {r.version for r in client.of("ok")} <= {"0", "1"}
    results["interlock"] = {
        "decisionToRefitEndSeconds": round(refit_ended - decided, 1),
        "newPodsCreatedAfterRefitSucceeded": True,
    }
