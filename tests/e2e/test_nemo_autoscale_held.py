"""KEDA scaling a fleet while NeMo RL's trainer holds its world, end to end (docs/autoscaling.md, "What
scaling does to a fleet"; docs/nemo-rl.md, "Scaling while the trainer holds the world").

The real components of the autoscale tier (Prometheus scraping the engine pods, KEDA's metrics server
feeding the HPA controller, the chart's ScaledObject; tests/e2e/test_autoscale.py) and NeMo RL's
trainer of tests/e2e/test_nemo_scale_held.py (:class:`helpers.nemo_held_trainer.Trainer`: its policy
side in a Ray actor, NeMo's fleet-health monitor attached, each training step NeMo's
``_sync_weights``), whose RefitSession holds the fleet throughout. The test never writes the fleet's
``/scale``; the HPA does:

* NeMo's rollout workers generate through an adapter of the fleet (three shards' worth of
  sequences): the waiting and running sequences Prometheus reads rise and the HPA scales the fleet
  1 -> 2. Shard 1 is placed at once, outside the trainer's world, Stale, the fleet held; the next
  step's rebuild names it, and its refit makes it current: it serves the rollouts at the fleet's
  version.
* The rollouts drop to one sequence at a time: the HPA scales the fleet back to 1. Shard 1 keeps its
  place in the world (``RefitSessionHeld`` says it leaves at the trainer's next rebuild), the next
  step's rebuild leaves it out and the operator removes it. No refit and no rollout fails, and the
  HPA writes nothing more.

Its tier is the autoscale one (marker ``autoscale``): Prometheus and KEDA are started for this module.
Its timeline (seconds from the load's start) is a property of the JUnit report's test suite (``--junitxml``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import autoscale_e2e as scaling
from helpers import nemo_fleet_health, nemo_serving, refit_e2e
from helpers import nemo_held_trainer as held
from megafleet.objects import Object
from megafleet.sdk import nemo
from megafleet_dev import autoscale, kube

pytestmark = [pytest.mark.autoscale, pytest.mark.timeout(600)]

WAIT = scaling.WAIT
ShardState = nemo_fleet_health.ShardState
SEQUENCES_PER_SHARD = 4
# The chart values of the ScaledObject (autoscaling.*): short windows to keep the test short.
SETTINGS = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "sequencesPerShard": SEQUENCES_PER_SHARD,
    "pollingInterval": 2,
    "cooldownPeriod": 30,
    "scaleDownStabilizationSeconds": 5,
    "scaleUpShardsPer15s": 1,
}
LOAD_WORKERS = 3  # each a batch of NeMo's four prompts: 12 sequences, three shards' worth
TRICKLE_ROWS = 1  # one sequence at a time while the fleet scales in: under one shard's worth
LOAD_CONFIG = {"generation": {"max_new_tokens": 48, "temperature": 1.0, "_pad_token_id": 0}}


class Rollouts:
    """NeMo's rollout workers: threads generating batches of :data:`helpers.nemo_serving.PROMPTS`
    (greedy) through an adapter of the fleet, one after another; what they got is kept by weight
    version, and what failed."""

    def __init__(self, generation: nemo.MegafleetGeneration) -> None:
        self.generation = generation
        self.versions: dict[int, int] = {}
        """Samples generated, by weight version."""
        self.failures: list[BaseException] = []
        self._workers: list[tuple[threading.Thread, threading.Event]] = []

    def run(self, workers: int, rows: int) -> None:
        """From now on ``workers`` threads, each generating batches of the first ``rows`` prompts; the
        threads running before end after their batch (waited for here)."""
        self.stop()
        for index in range(workers):
            stop = threading.Event()
            thread = threading.Thread(target=self._work, args=(stop, rows), name=f"rollouts-{index}", daemon=True)
            self._workers.append((thread, stop))
            thread.start()

    def stop(self) -> None:
        for _, stop in self._workers:
            stop.set()
        for thread, _ in self._workers:
            thread.join(timeout=WAIT)
            assert not thread.is_alive(), "a rollout batch never ended"
        self._workers = []

    def _work(self, stop: threading.Event, rows: int) -> None:
        data = {key: value[:rows] for key, value in nemo_serving.batch().items()}
        while not stop.is_set():
            try:
                out = self.generation.generate(data, greedy=True)
            except Exception as error:  # reported by the test
                self.failures.append(error)
                return
            for version in out["weight_versions"].tolist():
                self.versions[int(version)] = self.versions.get(int(version), 0) + 1


def rescales(kube_admin: kube.Kube, namespace: str) -> list[str]:
    """The HPA's ``SuccessfulRescale`` events, oldest first (``New size: N; reason: ...``)."""
    events = kube_admin.list(f"/api/v1/namespaces/{namespace}/events")["items"]
    found = [
        e
        for e in events
        if e["reason"] == "SuccessfulRescale" and e["involvedObject"]["kind"] == "HorizontalPodAutoscaler"
    ]
    return [e["message"] for e in sorted(found, key=lambda e: e.get("lastTimestamp") or e["eventTime"])]


def wait_for_metric(url: str, name: str, namespace: str, *, shard: int, above: float) -> float:
    """Poll Prometheus until shard ``shard``'s ``name`` exceeds ``above``; its value."""
    deadline = time.monotonic() + WAIT
    while (value := scaling.metric(url, name, namespace, held.FLEET, shard=shard)) <= above:
        assert time.monotonic() < deadline, f"{name} of shard {shard} stayed at {value}"
        time.sleep(scaling.SCRAPE_SECONDS)  # Prometheus's scrape pace
    return value


def live_sessions(kube_admin: kube.Kube, namespace: str) -> list[Object]:
    """The RefitSessions not on their way out: a rebuild closes and deletes the session before it,
    which may stay listed a moment longer (its finalizer)."""
    found: list[Object] = kube_admin.list(held.sessions(namespace))["items"]
    return [
        session
        for session in found
        if not session["metadata"].get("deletionTimestamp")
        and (session.get("status") or {}).get("phase") not in ("Broken", "Closed", "Failed")
    ]


def test_keda_scales_a_fleet_held_by_nemos_trainer_out_and_back_in_at_its_rebuilds(
    autoscaler: autoscale.Autoscale,
    kube_admin: kube.Kube,
    namespace: str,
    kubeconfig: Path,
    local_ray: None,
    record_testsuite_property: Callable[[str, object], None],
) -> None:
    url = autoscaler.prometheus_url
    fleet_path = held.fleet_path(namespace)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    timeline: dict[str, float] = {}

    def seen(name: str, obj: Object | None, replicas: int) -> None:
        if (obj or {}).get("spec", {}).get("replicas") == replicas:
            timeline.setdefault(name, time.monotonic())

    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet(replicas=1, refit={"bucketSizeMiB": 1}))
    scaling.autoscale_fleet(kube_admin, namespace, url, held.FLEET, SETTINGS)  # while the shard starts
    with held.training(namespace, kubeconfig, shards=1) as trainer:
        monitor = trainer.monitor
        [first] = kube_admin.list(held.sessions(namespace))["items"]
        rollouts = Rollouts(trainer.factory(config=LOAD_CONFIG))
        try:
            assert rollouts.generation.prepare_for_generation()
            timeline["load_started"] = time.monotonic()
            rollouts.run(LOAD_WORKERS, len(nemo_serving.PROMPTS))

            # The HPA scales 1 -> 2: shard 1 placed at once, outside the world, Stale, the fleet held.
            def shard_1_stale(obj: Object | None) -> bool:
                assert not rollouts.failures, rollouts.failures[:3]  # no load: no scale-out to wait for
                seen("scaled_out", obj, 2)
                return held.shard(obj, 1).get("phase") == "Stale"

            stale = kube_admin.wait(fleet_path, shard_1_stale, timeout=WAIT, what="KEDA's scale-out, shard 1 Stale")
            timeline["stale"] = time.monotonic()
            assert stale is not None and stale["spec"]["replicas"] == 2
            assert stale["status"]["refit"]["session"] == first["metadata"]["name"]
            assert "spec.replicas 2: shard 1 joins at the trainer's next rebuild" in held.message(stale), held.message(
                stale
            )
            assert held.shard(stale, 1).get("weightVersion") in (None, 0), held.shard(stale, 1)
            waiting = autoscale.query(
                url,
                f'max_over_time(sum(megafleet_waiting_sequences{{namespace="{namespace}"}}'
                f' + megafleet_running_sequences{{namespace="{namespace}"}})[5m:1s])',
            )
            assert waiting is not None and waiting > SEQUENCES_PER_SHARD, waiting

            # The next step's rebuild names it; its refit makes it current; it serves the rollouts.
            assert trainer.step(2), "rebuilt over shards 0 and 1"
            timeline["rebuilt_with"] = time.monotonic()
            assert monitor.state_of(1) is ShardState.HEALTHY and ("mark_loaded", 1) in monitor.calls, monitor.calls
            [second] = live_sessions(kube_admin, namespace)
            assert second["spec"]["shards"] == [0, 1] and second["spec"]["nemoCollective"]["worldSize"] == 4
            kube_admin.wait(
                fleet_path,
                lambda o: all(
                    (held.shard(o, i).get("phase"), held.shard(o, i).get("weightVersion")) == ("Ready", 2)
                    for i in range(2)
                ),
                timeout=WAIT,
                what="both shards Ready at version 2",
            )
            wait_for_metric(url, "megafleet_generated_tokens_total", namespace, shard=1, above=0)
            timeline["shard_1_served"] = time.monotonic()
            assert scaling.metric(url, "megafleet_weight_version", namespace, held.FLEET, shard=1) == 2

            # The rollouts drop to a trickle: the HPA scales 2 -> 1; shard 1 stays in the world.
            rollouts.run(1, TRICKLE_ROWS)
            timeline["load_ended"] = time.monotonic()

            def shard_1_leaving(obj: Object | None) -> bool:
                seen("scaled_in", obj, 1)
                return "spec.replicas 1: shard 1 leaves at the trainer's next rebuild" in held.message(obj)

            leaving = kube_admin.wait(fleet_path, shard_1_leaving, timeout=WAIT, what="KEDA's scale-in, shard 1 held")
            assert leaving is not None and kube_admin.get(f"{pods}/tiny-s1-p0") is not None, "kept while in the world"

            # The next step's rebuild leaves it out; then the operator removes it.
            assert trainer.step(3), "rebuilt without shard 1"
            timeline["rebuilt_without"] = time.monotonic()
            assert monitor.state_of(1) is ShardState.RETIRED and trainer.built == [0]
            [third] = live_sessions(kube_admin, namespace)
            assert third["spec"]["shards"] == [0]
            kube_admin.wait(f"{pods}/tiny-s1-p0", lambda o: o is None, timeout=WAIT, what="shard 1 removed")
            settled = kube_admin.wait(
                fleet_path,
                lambda o: o is not None and "join" not in held.message(o) and "leave" not in held.message(o),
                timeout=WAIT,
                what="nothing waits",
            )
            timeline["removed"] = time.monotonic()
            assert settled is not None and [s["index"] for s in settled["status"]["shards"]] == [0]
            rollouts.stop()
            nemo_serving.check_serves(trainer.generation, 3, version=3)
        finally:
            rollouts.stop()
            rollouts.generation.shutdown()

    assert rollouts.failures == [], rollouts.failures[:3]
    assert set(rollouts.versions) <= {1, 2, 3} and rollouts.versions.get(2), rollouts.versions
    held.refits_succeeded(kube_admin, namespace, range(1, 4))
    # The HPA wrote /scale twice, out then in, and nothing more (it did not fight the hold).
    assert [message.split(";")[0] for message in rescales(kube_admin, namespace)] == ["New size: 2", "New size: 1"]
    final = kube_admin.get(fleet_path)
    assert final is not None and final["spec"]["replicas"] == 1
    start = timeline["load_started"]
    record_testsuite_property(
        "nemoAutoscaleHeldSecondsFromLoadStart",
        {name: round(at - start, 1) for name, at in sorted(timeline.items(), key=lambda item: item[1])},
    )
