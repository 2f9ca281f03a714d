"""Refit recovery end to end (docs/refit-protocol.md), against the real control plane with real engine
processes and gloo on CPU: a shard killed in the middle of a refit is dropped and the retry succeeds
on the live shards; a restarted shard of a fleet that catches up from the checkpoint only comes back
Stale and unrouted until it caught up (at the next refit, or at once from the checkpoint the current
version came from; tests/e2e/test_catch_up_from_peer.py copies it from a peer); a reshard refit
through the operator. A client sends greedy requests to every frontend throughout, and every
response it gets must be exactly one weight version's output (the fleets drain: ``refit_e2e.DRAIN_IN_PLACE``)."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import pytest
import torch

from helpers import refit_e2e as base
from megafleet.objects import Object
from megafleet_dev import kube, runner
from megafleet_engine.models import tiny
from megafleet_protocol import ports, vocabulary
from megafleet_protocol.refit import errors
from megafleet_protocol.refit import sender as sdk

WAIT = 120
FLEET = "tiny"
MAX_TOKENS = 12
# The fleet's checkpoint is version 0; the trainer's weights of each later version.
SOURCES = {0: "tiny://llama", 1: "tiny://llama?seed=7", 2: "tiny://llama?seed=11"}


class Model:
    """A trainer's weights (one version) and the greedy output they give."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.model, _ = tiny.build_tiny(source)

    def greedy(self) -> list[int]:
        inputs = torch.tensor([base.PROMPT])
        with torch.inference_mode():
            output = self.model.generate(
                inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=MAX_TOKENS
            )
        return [int(token) for token in output[0, len(base.PROMPT) :]]

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, parameter.detach()) for name, parameter in self.model.named_parameters()]

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for _, tensor in self.weights())


@pytest.fixture(scope="module")
def models() -> dict[int, Model]:
    return {version: Model(source) for version, source in SOURCES.items()}


@dataclasses.dataclass
class Attempt:
    number: int
    world_size: int
    port: int
    report: sdk.SendReport | None = None
    error: BaseException | None = None


BeforeSend = Callable[[Attempt], None]


def refit(
    kube_admin: kube.Kube,
    namespace: str,
    model: Model,
    version: int,
    *,
    transport: vocabulary.Transport = "broadcast",
    before_send: BeforeSend | None = None,
) -> tuple[Object, list[Attempt]]:
    """What a trainer does: create the Refit, run each attempt the operator publishes on its own
    port and world size, give an attempt up when the operator moves on, until the Refit is done.
    ``before_send`` runs on the sender's thread once every member joined, before any weight moves."""
    port = base.free_port()
    name = f"{FLEET}-v{version}"
    path = f"{base.refits(namespace)}/{name}"
    kube_admin.create(
        base.refits(namespace),
        {
            "apiVersion": "megafleet.dev/v1alpha1",
            "kind": "Refit",
            "metadata": {"name": name},
            "spec": {
                "fleetRef": {"name": FLEET},
                "version": version,
                "source": {"rendezvous": {"address": base.TRAINER_ADDRESS, "port": port, "trainerWorldSize": 1}},
            },
        },
    )
    attempts: list[Attempt] = []
    while True:
        previous = len(attempts)
        running = kube_admin.wait(
            path,
            functools.partial(_published, previous=previous),
            timeout=WAIT,
            what=f"the operator to publish attempt {previous + 1}",
        )
        assert running is not None
        if _phase(running) != "Running":
            return running, attempts
        attempt = Attempt(_attempts(running), running["status"]["membership"]["worldSize"], 0)
        attempt.port = ports.attempt_port(port, attempt.number)
        attempts.append(attempt)
        sender = sdk.WeightSender(attempt.port, attempt.world_size, address=base.TRAINER_ADDRESS, timeout_seconds=60)

        def send(attempt: Attempt = attempt, sender: sdk.WeightSender = sender) -> None:
            try:
                sender.init()
                weights: Iterable[tuple[str, torch.Tensor]] = model.weights()
                if before_send is not None:
                    before_send(attempt)
                attempt.report = sender.send(weights, bucket_size_mib=1, version=version, transport=transport)
            except BaseException as error:  # handed to the test thread
                attempt.error = error
            finally:
                sender.close()

        thread = threading.Thread(target=send, name=f"trainer-attempt-{attempt.number}", daemon=True)
        thread.start()
        outcome = kube_admin.wait(
            path,
            functools.partial(_moved_on, number=attempt.number),
            timeout=WAIT,
            what=f"attempt {attempt.number} to end",
        )
        assert outcome is not None
        if _phase(outcome) not in ("Succeeded", "Failed"):
            sender.abort()  # the operator gave this attempt up: stop waiting for its dead members
        thread.join(timeout=WAIT)
        assert not thread.is_alive(), f"attempt {attempt.number} still blocked after the operator moved on"


def _phase(refit: Object | None) -> str | None:
    phase = (refit or {}).get("status", {}).get("phase")
    return None if phase is None else str(phase)


def _published(refit: Object | None, *, previous: int) -> bool:
    """A new attempt is Running (or the Refit is over)."""
    return _phase(refit) in ("Succeeded", "Failed") or (_phase(refit) == "Running" and _attempts(refit) > previous)


def _moved_on(refit: Object | None, *, number: int) -> bool:
    """Attempt ``number`` is over: the Refit finished, or the operator published the next attempt."""
    return _phase(refit) in ("Succeeded", "Failed") or _attempts(refit) > number


def _attempts(refit: Object | None) -> int:
    return int((refit or {}).get("status", {}).get("attempts", 0))


def kill_engine(pod_runner: runner.Runner, namespace: str, pod: str) -> int:
    """SIGKILL the engine process the runner started for ``pod`` (as a crashing GPU would end it)."""
    folder = pod_runner.workdir / namespace / pod
    process = next(p for p in list(pod_runner.processes.values()) if p.log.parent == folder)
    os.killpg(process.popen.pid, signal.SIGKILL)
    return process.popen.pid


@dataclasses.dataclass(frozen=True)
class Response:
    pod: str
    uid: str
    status: int
    version: str | None
    tokens: tuple[int, ...]


class Traffic:
    """A client sending the same greedy request to every frontend pod of the fleet, round after
    round, on its own thread and API connection, until stopped; it keeps every answer."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.namespace = namespace
        self.responses: list[Response] = []
        self.rounds = 0
        self._kube = kube.Kube.from_kubeconfig(kubeconfig)
        self._stop = threading.Event()
        self._round = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        self.wait_rounds(1)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self._kube.close()

    def wait_rounds(self, count: int) -> None:
        target = self.rounds + count
        with self._round:
            assert self._round.wait_for(lambda: self.rounds >= target, timeout=WAIT), "the client is stuck"

    def of(self, predicate: Callable[[Response], bool]) -> list[Response]:
        return [response for response in list(self.responses) if predicate(response)]

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                pods = self._kube.list(f"/api/v1/namespaces/{self.namespace}/pods")["items"]
                for pod in pods:
                    if pod["metadata"]["labels"].get("megafleet.dev/pod-index") == "0" and pod["status"].get("podIP"):
                        self._ask(client, pod)
                with self._round:
                    self.rounds += 1
                    self._round.notify_all()
                self._stop.wait(0.2)  # pacing of the load, not synchronisation

    def _ask(self, client: httpx.Client, pod: Object) -> None:
        body = {
            "model": FLEET,
            "prompt": base.PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        try:
            answer = client.post(f"http://{pod['status']['podIP']}:8000/v1/completions", json=body)
        except httpx.HTTPError:
            return  # the engine process is not there (killed, or not started yet)
        tokens = tuple(answer.json()["choices"][0]["token_ids"]) if answer.status_code == 200 else ()
        self.responses.append(
            Response(
                pod["metadata"]["name"],
                pod["metadata"]["uid"],
                answer.status_code,
                answer.headers.get("X-Megafleet-Weight-Version"),
                tokens,
            )
        )


def assert_one_version_each(traffic: Traffic, expected: dict[int, list[int]]) -> None:
    """Every answer is exactly the greedy output of the version it is stamped with: none was
    produced by a mix of two versions, and none came from a shard that was not serving."""
    served = traffic.of(lambda r: r.status == 200)
    assert served, "the client got no answer at all"
    for response in served:
        assert response.version is not None and int(response.version) in expected, response
        assert list(response.tokens) == expected[int(response.version)], response
    assert {r.status for r in traffic.responses} <= {200, 503}, {r.status for r in traffic.responses}


def frontend(kube_admin: kube.Kube, namespace: str, pod: str) -> str:
    found = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
    assert found is not None
    return f"http://{found['status']['podIP']}:8000"


def shard(obj: Object | None, index: int) -> Object:
    return next((s for s in (obj or {}).get("status", {}).get("shards", []) if s["index"] == index), {})


def fleet_path(namespace: str) -> str:
    return f"{base.fleets(namespace)}/{FLEET}"


def serves(kube_admin: kube.Kube, namespace: str, fleet: Object, version: int, tokens: list[int]) -> None:
    for entry in fleet["status"]["shards"]:
        assert base.served(kube_admin, namespace, entry["pods"][0]) == (tokens, str(version)), entry


def test_a_shard_killed_mid_refit_is_dropped_the_retry_succeeds_and_it_rejoins_only_once_current(
    operator: Path,
    pod_runner: runner.Runner,
    kubeconfig: Path,
    kube_admin: kube.Kube,
    namespace: str,
    models: dict[int, Model],
) -> None:
    expected = {version: model.greedy() for version, model in models.items()}
    # catchUp checkpoint: the restarted shard has no peer copy, so it stays Stale until the next refit
    # (tests/e2e/test_catch_up_from_peer.py heals one from a peer).
    settings = {**base.DRAIN_IN_PLACE, "timeoutSeconds": 60}  # answers of one version each; suspended members
    manifest = base.tiny_fleet(replicas=3, refit=settings, weights={"catchUp": "checkpoint"})
    kube_admin.create(base.fleets(namespace), manifest)
    assert kube_admin.wait(fleet_path(namespace), base.ready, timeout=WAIT) is not None
    original = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{FLEET}-s1-p0")
    assert original is not None
    killed: list[int] = []

    def kill_shard_1(attempt: Attempt) -> None:
        if attempt.number == 1:  # every member has joined and suspended; no weight has moved yet
            killed.append(kill_engine(pod_runner, namespace, f"{FLEET}-s1-p0"))

    with Traffic(kubeconfig, namespace) as traffic:
        result, attempts = refit(kube_admin, namespace, models[1], 1, before_send=kill_shard_1)

        assert killed and result["status"]["phase"] == "Succeeded", result["status"]["message"]
        assert [(a.number, a.world_size) for a in attempts] == [(1, 4), (2, 3)]  # trainer + 3, then + 2
        assert isinstance(attempts[0].error, errors.RefitError), attempts[0].error  # given up, not hung
        assert attempts[1].error is None and attempts[1].report is not None
        assert attempts[1].port == attempts[0].port + 1 and attempts[1].report.receivers == 2
        assert [o["shard"] for o in result["status"]["membership"]["rankOffsets"]] == [0, 2]
        assert result["status"]["membership"] == {
            "worldSize": 3,
            "trainerWorldSize": 1,
            "rankOffsets": [{"shard": 0, "offset": 1}, {"shard": 2, "offset": 2}],
        }

        # The killed shard is re-placed after the refit and comes back Stale: no weights, not routed.
        stale = kube_admin.wait(
            fleet_path(namespace),
            lambda o: shard(o, 1).get("phase") == "Stale" and shard(o, 1).get("restarts") == 1,
            timeout=WAIT,
            what="shard 1 restarted and Stale",
        )
        assert stale is not None
        assert stale["status"]["readyReplicas"] == 2 and stale["status"]["weightVersion"] == 1
        assert not base.ready(stale) and (kube.condition(stale, "Degraded") or {}).get("status") == "True"
        weights = kube.condition(stale, "WeightsCurrent") or {}
        assert weights.get("status") == "False" and "[1]" in weights.get("message", ""), weights
        restarted = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{FLEET}-s1-p0")
        assert restarted is not None and restarted["metadata"]["uid"] != original["metadata"]["uid"]
        env = {e["name"]: e.get("value") for e in restarted["spec"]["containers"][0]["env"]}
        assert env["MEGAFLEET_WEIGHTS_INITIAL"] == "refit"  # it never loads the stale checkpoint
        probe = restarted["spec"]["containers"][0]["readinessProbe"]["httpGet"]
        url = frontend(kube_admin, namespace, f"{FLEET}-s1-p0")
        assert httpx.get(f"{url}{probe['path']}").status_code == 503  # out of its Service's endpoints
        refused = httpx.post(f"{url}/v1/completions", json={"model": FLEET, "prompt": base.PROMPT, "max_tokens": 2})
        assert refused.status_code == 503
        for index in (0, 2):
            pod = shard(stale, index)["pods"][0]
            assert base.served(kube_admin, namespace, pod) == (expected[1], "1")
        traffic.wait_rounds(2)

        # The next refit includes it again (no checkpoint to catch up from): all three at version 2.
        result, attempts = refit(kube_admin, namespace, models[2], 2)

        assert result["status"]["phase"] == "Succeeded", result["status"]
        assert [(a.number, a.world_size) for a in attempts] == [(1, 4)]
        fleet = kube_admin.wait(
            fleet_path(namespace),
            lambda o: base.ready(o) and (o or {})["status"].get("weightVersion") == 2,
            timeout=WAIT,
            what="every shard Ready at version 2",
        )
        assert fleet is not None and [s["restarts"] for s in fleet["status"]["shards"]] == [0, 1, 0]
        serves(kube_admin, namespace, fleet, 2, expected[2])
        traffic.wait_rounds(2)

    assert_one_version_each(traffic, expected)
    new_uid = restarted["metadata"]["uid"]
    assert {r.version for r in traffic.of(lambda r: r.uid == new_uid and r.status == 200)} <= {"2"}
    assert traffic.of(lambda r: r.status == 200 and r.version == "0")  # the client ran from the start


def test_a_shard_restarted_after_a_checkpoint_refit_is_stale_until_it_loaded_that_checkpoint(
    operator: Path,
    pod_runner: runner.Runner,
    kubeconfig: Path,
    kube_admin: kube.Kube,
    namespace: str,
    models: dict[int, Model],
) -> None:
    expected = {version: model.greedy() for version, model in models.items() if version < 2}
    manifest = base.tiny_fleet(replicas=2, refit=base.DRAIN_IN_PLACE, weights={"catchUp": "checkpoint"})
    kube_admin.create(base.fleets(namespace), manifest)  # drain: every answer is one version's
    assert kube_admin.wait(fleet_path(namespace), base.ready, timeout=WAIT) is not None
    kube_admin.create(
        base.refits(namespace),
        {
            "apiVersion": "megafleet.dev/v1alpha1",
            "kind": "Refit",
            "metadata": {"name": "tiny-v1"},
            "spec": {"fleetRef": {"name": FLEET}, "version": 1, "source": {"checkpoint": {"path": SOURCES[1]}}},
        },
    )
    done = kube_admin.wait(
        f"{base.refits(namespace)}/tiny-v1", lambda r: _phase(r) in ("Succeeded", "Failed"), timeout=WAIT
    )
    assert done is not None and done["status"]["phase"] == "Succeeded", (done or {}).get("status")
    fleet = kube_admin.wait(
        fleet_path(namespace), lambda o: base.ready(o) and (o or {})["status"].get("weightVersion") == 1, timeout=WAIT
    )
    assert fleet is not None and fleet["status"]["refit"]["currentCheckpoint"] == SOURCES[1]
    original = fleet["status"]["shards"][1]

    with Traffic(kubeconfig, namespace) as traffic:
        kill_engine(pod_runner, namespace, f"{FLEET}-s1-p0")
        phases: list[str] = []

        def caught_up(obj: Object | None) -> bool:
            entry = shard(obj, 1)
            if entry.get("restarts") == 1 and (not phases or phases[-1] != entry.get("phase")):
                phases.append(entry.get("phase", ""))
            return base.ready(obj) and entry.get("restarts") == 1 and entry.get("weightVersion") == 1

        fleet = kube_admin.wait(fleet_path(namespace), caught_up, timeout=WAIT, what="shard 1 back at version 1")
        assert fleet is not None
        traffic.wait_rounds(2)

    # Re-placed, started without weights (Stale), then Ready through the checkpoint: never Ready before.
    assert "Stale" in phases and phases[-1] == "Ready" and phases.index("Stale") < phases.index("Ready"), phases
    assert original["restarts"] == 0 and fleet["status"]["refit"]["currentVersion"] == 1
    serves(kube_admin, namespace, fleet, 1, expected[1])
    events = kube_admin.list(f"/api/v1/namespaces/{namespace}/events")["items"]
    assert any(e["reason"] == "ShardCatchingUp" and "shard 1" in e["message"] for e in events)
    assert_one_version_each(traffic, expected)
    restarted = fleet["status"]["shards"][1]["pods"][0]
    assert {r.version for r in traffic.of(lambda r: r.pod == restarted and r.status == 200)} <= {"1"}


def test_a_reshard_refit_through_the_operator_sends_each_rank_its_regions_point_to_point(
    operator: Path, kube_admin: kube.Kube, namespace: str, models: dict[int, Model]
) -> None:
    kube_admin.create(base.fleets(namespace), base.tiny_fleet(replicas=2, refit={"transport": "reshard"}))
    assert kube_admin.wait(fleet_path(namespace), base.ready, timeout=WAIT) is not None

    # A trainer that broadcasts to a reshard fleet is refused before any byte moves.
    result, attempts = refit(kube_admin, namespace, models[1], 1, transport="broadcast")
    assert result["status"]["phase"] == "Failed" and "broadcast transport" in result["status"]["message"]
    assert all(isinstance(a.error, errors.RefitRejected) for a in attempts), attempts

    result, attempts = refit(kube_admin, namespace, models[2], 2, transport="reshard")

    assert result["status"]["phase"] == "Succeeded", result["status"]
    report = attempts[-1].report
    assert report is not None and report.transport == "reshard" and report.receivers == 2
    # A transformers rank holds whole tensors: the regions it asks for are the whole model, sent to
    # each rank on its own (broadcast would send it once to all).
    assert report.bytes_sent >= 2 * models[2].nbytes
    fleet = kube_admin.wait(
        fleet_path(namespace),
        lambda o: base.ready(o) and (o or {})["status"].get("weightVersion") == 2,
        timeout=WAIT,
        what="both shards at version 2",
    )
    assert fleet is not None
    serves(kube_admin, namespace, fleet, 2, models[2].greedy())
