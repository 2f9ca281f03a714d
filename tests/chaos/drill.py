"""The operator chaos drill (docs/development.md#chaos-drills-and-the-soak): a tiny CPU fleet driven
through create, scale up, scale down, a template roll, a rendezvous refit and a checkpoint catch-up
while a client hammers every Ready frontend, and the operator is SIGKILLed (and a new one started at
once) at seeded random points of those steps. Each step must converge to its declared state; at the
end nothing is orphaned or duplicated, and no client request failed or got a mixed-version answer.

Used by ``tests/chaos/test_operator_chaos.py`` (``make chaos``; ``make test`` runs a short one).
Knobs: ``MEGAFLEET_CHAOS_KILLS`` (kill points, default :data:`DEFAULT_KILLS`) and
``MEGAFLEET_CHAOS_SEED`` (default :data:`DEFAULT_SEED`).

The client is what an RL job does: each request goes to a shard the fleet's status calls Ready,
and one that meets a closed port or a 503 (a pod being replaced) is retried on a Ready shard until
:data:`REQUEST_DEADLINE_SECONDS`; a request across a refit's suspend is held by the engine. A
request is *failed* if no shard answered it by its deadline, *mixed* if its tokens are not the greedy
output of the weight version its response is stamped with.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import torch

from helpers import operators as operators_module
from helpers import refit_e2e as base
from megafleet.objects import Object
from megafleet_dev import kube, runner
from megafleet_engine.models import tiny
from megafleet_protocol import ports
from megafleet_protocol.refit import sender as sdk

DEFAULT_KILLS = 5
"""Kill points of a drill when ``MEGAFLEET_CHAOS_KILLS`` is unset (CI); the issue's full drill is 20."""
DEFAULT_SEED = 16
KILL_WINDOW_SECONDS = 6.0
"""A step's kill points fall within this long after the step's action started."""
STEP_TIMEOUT_SECONDS = 240
REQUEST_DEADLINE_SECONDS = 90
MAX_TOKENS = 6
FLEET = "tiny"
SOURCES = {0: "tiny://llama", 1: base.TRAINER_SOURCE, 2: "tiny://llama?seed=11"}
"""The weights of each version: the checkpoint, the trainer's refit, the checkpoint refit."""
STEPS = ("create", "scale-up", "scale-down", "template-roll", "refit", "catch-up")


def greedy(source: str) -> list[int]:
    model, _ = tiny.build_tiny(source)
    inputs = torch.tensor([base.PROMPT])
    with torch.inference_mode():
        output = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=MAX_TOKENS
        )
    return [int(token) for token in output[0, len(base.PROMPT) :]]


def knobs() -> tuple[int, int]:
    """(kill points, seed) from the environment."""
    return int(os.environ.get("MEGAFLEET_CHAOS_KILLS", DEFAULT_KILLS)), int(
        os.environ.get("MEGAFLEET_CHAOS_SEED", DEFAULT_SEED)
    )


def schedule(kills: int, seed: int) -> dict[str, list[float]]:
    """The kill points: for each step, the sorted delays (seconds after its action started)."""
    rng = random.Random(seed)
    points: dict[str, list[float]] = {step: [] for step in STEPS}
    for _ in range(kills):
        points[rng.choice(STEPS)].append(round(rng.uniform(0.0, KILL_WINDOW_SECONDS), 2))
    return {step: sorted(delays) for step, delays in points.items()}


SPREAD_ORDER = ("create", "refit", "scale-up", "catch-up", "scale-down", "template-roll")
"""The steps :func:`spread` visits in turn, so a short drill still covers create, refit and scale."""


def spread(faults: int, seed: int) -> dict[str, list[float]]:
    """Fault points visiting the steps in :data:`SPREAD_ORDER` in turn (the control-plane drills,
    where each fault is slow), each at a seeded random delay within the kill window."""
    rng = random.Random(seed)
    points: dict[str, list[float]] = {step: [] for step in STEPS}
    for index in range(faults):
        points[SPREAD_ORDER[index % len(SPREAD_ORDER)]].append(round(rng.uniform(0.0, KILL_WINDOW_SECONDS), 2))
    return {step: sorted(delays) for step, delays in points.items()}


@dataclasses.dataclass(frozen=True)
class Outcome:
    at: float
    status: str  # served | failed | mixed
    target: str = ""
    """The frontend that answered (empty when none did)."""
    version: int | None = None
    """The weight version the answer was stamped with."""


class Client:
    """The hammering client, on its own thread: one request to every Ready shard per round."""

    def __init__(self, kubeconfig: Path, namespace: str, expected: dict[int, list[int]]) -> None:
        self.namespace = namespace
        self.expected = expected
        self.outcomes: list[Outcome] = []
        self._kube = kube.Kube.from_kubeconfig(kubeconfig)
        self._last_targets: list[str] = []
        self._openai: dict[str, openai.OpenAI] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-client", daemon=True)

    def __enter__(self) -> Client:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUEST_DEADLINE_SECONDS + 30)
        self._kube.close()

    def count(self, start: float, end: float) -> collections.Counter[str]:
        return collections.Counter(o.status for o in list(self.outcomes) if start <= o.at <= end)

    def _targets(self) -> list[str]:
        """Frontend addresses of the shards the fleet's status calls Ready (what an RL client routes to);
        while the API server cannot answer (a control-plane drill), the last ones it gave."""
        try:
            fleet = self._kube.get(f"{base.fleets(self.namespace)}/{FLEET}") or {}
            pods = self._kube.list(f"/api/v1/namespaces/{self.namespace}/pods")["items"]
        except (httpx.HTTPError, kube.KubeError):
            return self._last_targets
        ready = {s["pods"][0] for s in fleet.get("status", {}).get("shards", []) if s.get("phase") == "Ready"}
        self._last_targets = [
            f"http://{p['status']['podIP']}:8000"
            for p in pods
            if p["metadata"]["name"] in ready and p["status"].get("podIP")
        ]
        return self._last_targets

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for target in self._targets():
                    self.outcomes.append(self._ask(target))
                self._stop.wait(0.1)  # pacing of the load, not synchronisation
        finally:
            for client in self._openai.values():
                client.close()

    def _ask(self, target: str) -> Outcome:
        """One completion through the official ``openai`` client, retried on another Ready shard
        until the deadline; served, mixed (tokens not those of the stamped version) or failed."""
        deadline = time.monotonic() + REQUEST_DEADLINE_SECONDS
        while time.monotonic() < deadline:
            client = self._openai.get(target)
            if client is None:
                client = self._openai[target] = openai.OpenAI(
                    base_url=f"{target}/v1", api_key="unused", max_retries=0, timeout=60
                )
            try:
                raw = client.completions.with_raw_response.create(
                    model=FLEET,
                    prompt=base.PROMPT,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_body={"return_token_ids": True},
                )
            except openai.OpenAIError:
                raw = None
            if raw is not None:
                version = int(raw.headers["X-Megafleet-Weight-Version"])
                tokens = (raw.parse().choices[0].model_extra or {})["token_ids"]
                status = "served" if tokens == self.expected.get(version) else "mixed"
                return Outcome(time.monotonic(), status, target, version)
            time.sleep(0.2)  # back-off before the retry on another Ready shard
            targets = self._targets()
            if targets:
                target = random.choice(targets)
        return Outcome(time.monotonic(), "failed")


@dataclasses.dataclass
class StepReport:
    step: str
    kills: int
    converge_seconds: float
    served: int
    failed: int
    mixed: int


class Drill:
    """One drill in ``namespace``: the steps, the kills, the reports."""

    def __init__(
        self,
        kube_admin: kube.Kube,
        kubeconfig: Path,
        pod_runner: runner.Runner,
        operators: operators_module.Operators,
        namespace: str,
        points: dict[str, list[float]],
        fault: Callable[[], None] | None = None,
    ) -> None:
        self.kube = kube_admin
        self.kubeconfig = kubeconfig
        self.pod_runner = pod_runner
        self.operators = operators
        self.namespace = namespace
        self.points = points
        self.operator = operators.start()
        self.fault = fault or self.restart_operator
        """What happens at each point of the schedule (default: the operator SIGKILLed and restarted)."""
        self.reports: list[StepReport] = []
        self.fleet_path = f"{base.fleets(namespace)}/{FLEET}"
        self.refits_made: list[str] = []
        self.replicas = 2
        """The shards the fleet should end with (:meth:`run` keeps it)."""

    # -- the frame of every step -------------------------------------------------------------

    def restart_operator(self) -> None:
        self.operators.kill(self.operator)
        self.operator = self.operators.start()

    def step(
        self,
        name: str,
        action: Callable[[], Callable[[], None] | None],
        converged: Callable[[], bool],
        client: Client | None,
    ) -> None:
        """Run ``action`` (it may return a function to join, e.g. a trainer thread), inject the fault at
        the step's points, and wait until ``converged`` (an API error while polling counts as not yet)."""
        started = time.monotonic()
        finish = action()
        for delay in self.points[name]:
            time.sleep(max(0.0, started + delay - time.monotonic()))  # the chaos schedule itself
            self.fault()
        if finish is not None:
            finish()
        deadline = started + STEP_TIMEOUT_SECONDS
        while not holds(converged):
            assert time.monotonic() < deadline, (
                f"step {name} did not converge in {STEP_TIMEOUT_SECONDS} s; shards: {self.shards_seen()}"
            )
            time.sleep(0.25)  # polling the declared state, with a deadline
        ended = time.monotonic()
        counts = client.count(started, ended) if client is not None else collections.Counter[str]()
        self.reports.append(
            StepReport(
                name,
                len(self.points[name]),
                round(ended - started, 1),
                counts["served"],
                counts["failed"],
                counts["mixed"],
            )
        )

    def shards_seen(self) -> object:
        """The fleet's ``status.shards`` for a failure message (the API error if it cannot be read)."""
        try:
            return self.fleet().get("status", {}).get("shards")
        except (httpx.HTTPError, kube.KubeError) as error:
            return repr(error)

    # -- declared states ----------------------------------------------------------------------

    def fleet(self) -> Object:
        return self.kube.get(self.fleet_path) or {}

    def settled(self, replicas: int, version: int) -> bool:
        """Ready at ``version`` with exactly ``replicas`` shards, one pod each, none being replaced."""
        fleet = self.fleet()
        status = fleet.get("status", {})
        pods = self.kube.list(f"/api/v1/namespaces/{self.namespace}/pods")["items"]
        names = sorted(p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp"))
        return (
            base.ready(fleet)
            and status.get("readyReplicas") == replicas
            and status.get("weightVersion") == version
            and not (status.get("refit") or {}).get("active")
            and names == [f"{FLEET}-s{i}-p0" for i in range(replicas)]
            and len(pods) == replicas
            and all(s.get("phase") == "Ready" for s in status.get("shards", []))
        )

    def hashes(self) -> set[str]:
        pods = self.kube.list(f"/api/v1/namespaces/{self.namespace}/pods")["items"]
        return {p["metadata"]["annotations"]["megafleet.dev/template-hash"] for p in pods}

    # -- the steps -------------------------------------------------------------------------------

    def refit_rendezvous(self, version: int, source: str) -> Callable[[], None]:
        """Create the Refit and run the trainer on a thread (attempt after attempt, as a trainer
        does); returns the join of that thread."""
        port = base.free_port()
        name = f"{FLEET}-v{version}"
        self.refits_made.append(name)
        path = base.create_refit(self.kube, self.namespace, FLEET, version, port=port)
        model, _ = tiny.build_tiny(source)
        weights = [(n, p.detach()) for n, p in model.named_parameters()]
        trainer_kube = kube.Kube.from_kubeconfig(self.kubeconfig)

        def trainer() -> None:
            done = 0
            try:
                while True:
                    try:
                        refit = trainer_kube.wait(
                            path, functools.partial(_moved_on, after=done), timeout=STEP_TIMEOUT_SECONDS
                        )
                    except (httpx.HTTPError, kube.KubeError):
                        time.sleep(0.5)  # the API server is restarting (a control-plane drill): ask again
                        continue
                    if refit is None or refit_phase(refit) != "Running":
                        return
                    done = refit_attempts(refit)
                    membership = refit["status"]["membership"]
                    sender = sdk.WeightSender(
                        ports.attempt_port(port, done),
                        membership["worldSize"],
                        address=base.TRAINER_ADDRESS,
                        timeout_seconds=60,
                    )
                    try:
                        sender.init()
                        sender.send(weights, bucket_size_mib=1, version=version)
                    except Exception:
                        pass  # the attempt was given up: the next one (or the end) comes from the status
                    finally:
                        sender.close()
            finally:
                trainer_kube.close()

        thread = threading.Thread(target=trainer, name="chaos-trainer", daemon=True)
        thread.start()
        return lambda: thread.join(timeout=STEP_TIMEOUT_SECONDS)

    def refit_checkpoint(self, version: int, source: str) -> None:
        """Create a checkpoint Refit (the catch-up step kills a shard once it succeeded)."""
        name = f"{FLEET}-v{version}"
        self.refits_made.append(name)
        base.create_refit(self.kube, self.namespace, FLEET, version, checkpoint=source)

    def engine_pid(self, pod: str) -> int:
        """The PID of ``pod``'s engine core (its API servers are its children, in its process group)."""
        folder = self.pod_runner.workdir / self.namespace / pod
        process = next(p for p in list(self.pod_runner.processes.values()) if p.log.parent == folder)
        return process.popen.pid

    def kill_engine(self, pod: str) -> None:
        os.killpg(self.engine_pid(pod), signal.SIGKILL)

    def run(self, expected: dict[int, list[int]], steps: tuple[str, ...] = STEPS) -> None:
        """The steps in :data:`STEPS` order; ``steps`` may leave some out (create always runs, the
        catch-up needs the refit), and the replicas expected afterwards follow the scale steps run."""
        ns = self.namespace
        scale = f"{self.fleet_path}/scale"

        def create() -> None:
            # drain: a request's tokens are the greedy output of the one version stamped on it
            refit = {**base.DRAIN_IN_PLACE, "timeoutSeconds": 30}
            manifest = base.tiny_fleet(replicas=2, refit=refit, weights={"catchUp": "checkpoint"})
            self.kube.create(base.fleets(ns), manifest)  # the catch-up step is the checkpoint's

        def scale_to(replicas: int) -> Callable[[], None]:
            return lambda: ignore(self.kube.patch(scale, {"spec": {"replicas": replicas}}))

        def roll() -> None:
            self.kube.patch(self.fleet_path, {"spec": {"engine": {"maxBatchSize": 4}}})

        def catch_up() -> None:
            self.refit_checkpoint(2, SOURCES[2])
            deadline = time.monotonic() + STEP_TIMEOUT_SECONDS
            while not holds(lambda: refit_phase(self.kube.get(f"{base.refits(ns)}/{FLEET}-v2")) == "Succeeded"):
                assert time.monotonic() < deadline, "the checkpoint refit did not succeed"
                time.sleep(0.25)  # polling the Refit, with a deadline
            self.kill_engine(f"{FLEET}-s1-p0")

        self.step("create", simple_action(create), lambda: self.settled(2, 0), None)
        with Client(self.kubeconfig, ns, expected) as client:

            def run_step(
                name: str, act: Callable[[], Callable[[], None] | None], converged: Callable[[], bool]
            ) -> None:
                if name in steps:
                    self.step(name, act, converged, client)

            run_step("scale-up", simple_action(scale_to(3)), lambda: self.settled(3, 0))
            self.replicas = 3 if "scale-up" in steps else 2
            run_step("scale-down", simple_action(scale_to(2)), lambda: self.settled(2, 0))
            self.replicas = 2 if "scale-down" in steps else self.replicas
            before = self.hashes()
            run_step(
                "template-roll",
                simple_action(roll),
                lambda: self.settled(self.replicas, 0) and not self.hashes() & before,
            )
            run_step("refit", lambda: self.refit_rendezvous(1, SOURCES[1]), lambda: self.settled(self.replicas, 1))
            restarts = _restarts(self.fleet())
            run_step(
                "catch-up",
                simple_action(catch_up),
                lambda: self.settled(self.replicas, 2) and _restarts(self.fleet()) > restarts,
            )

    def leftovers(self) -> list[str]:
        """What is orphaned, duplicated or untrue at the end (empty when the drill converged)."""
        problems: list[str] = []
        fleet = self.fleet()
        uid = fleet["metadata"]["uid"]
        # One frontends Service (up to 100 shards): the drill's one-pod shards have no ranks Service
        # (their ranks meet inside the pod).
        expected = {"pods": self.replicas, "services": 1 if self.replicas else 0, "configmaps": 1, "secrets": 1}
        for kind, count in expected.items():
            items = self.kube.list(
                f"/api/v1/namespaces/{self.namespace}/{kind}", label_selector=f"megafleet.dev/fleet={FLEET}"
            )["items"]
            if len(items) != count:
                problems.append(f"{len(items)} {kind}, expected {count}")
            problems += [
                f"{kind} {i['metadata']['name']} not owned by the fleet"
                for i in items
                if [o["uid"] for o in i["metadata"].get("ownerReferences", [])] != [uid]
            ]
        pods = self.kube.list(f"/api/v1/namespaces/{self.namespace}/pods")["items"]
        if len(pods) != self.replicas:
            problems.append(f"{len(pods)} pods in the namespace")
        refits = self.kube.list(base.refits(self.namespace))["items"]
        if sorted(r["metadata"]["name"] for r in refits) != sorted(self.refits_made):
            problems.append(f"Refits {[r['metadata']['name'] for r in refits]}, made {self.refits_made}")
        problems += [f"Refit {r['metadata']['name']} {refit_phase(r)}" for r in refits if refit_phase(r) != "Succeeded"]
        status = fleet.get("status", {})
        if not base.ready(fleet) or status.get("readyReplicas") != fleet["spec"]["replicas"]:
            problems.append(f"fleet not Ready at its replicas: {status.get('conditions')}")
        if status.get("observedGeneration", fleet["metadata"]["generation"]) != fleet["metadata"]["generation"]:
            problems.append("status.observedGeneration is behind")
        return problems


def holds(check: Callable[[], bool]) -> bool:
    """``check()``, False while the API server cannot answer it (a control-plane drill)."""
    try:
        return check()
    except (httpx.HTTPError, kube.KubeError):
        return False


def simple_action(function: Callable[[], object]) -> Callable[[], Callable[[], None] | None]:
    """A step action with nothing to join afterwards."""

    def run() -> None:
        function()

    return run


def ignore(value: object) -> None:
    del value


def refit_phase(obj: Object | None) -> str | None:
    phase = (obj or {}).get("status", {}).get("phase")
    return None if phase is None else str(phase)


def refit_attempts(obj: Object | None) -> int:
    return int((obj or {}).get("status", {}).get("attempts", 0))


def _moved_on(refit: Object | None, *, after: int) -> bool:
    """The Refit ended, or the operator published an attempt after ``after``."""
    return refit_phase(refit) in ("Succeeded", "Failed") or refit_attempts(refit) > after


def _restarts(fleet: Object) -> int:
    return sum(int(s.get("restarts", 0)) for s in fleet.get("status", {}).get("shards", []))


def table(reports: list[StepReport]) -> Iterator[str]:
    yield f"{'step':<14}{'faults':>7}{'converge s':>12}{'served':>8}{'failed':>8}{'mixed':>7}"
    for r in reports:
        yield f"{r.step:<14}{r.kills:>7}{r.converge_seconds:>12}{r.served:>8}{r.failed:>8}{r.mixed:>7}"
