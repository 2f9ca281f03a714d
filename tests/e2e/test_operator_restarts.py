"""Operator restarts and replicas against the real control plane with real engine processes: an
operator SIGKILLed while a Refit runs leaves that Refit to its successor, which finishes it, and no
engine stays suspended; two operators started at once with peering keep exactly one acting
(docs/incidents.md#peering-replicas-both-acted), and killing the active one lets the other take
over."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers import operators as operators_module
from helpers import refit_e2e as base
from megafleet.objects import Object
from megafleet_dev import kube, runner
from megafleet_protocol import ports
from megafleet_protocol.refit import sender as sdk

WAIT = 240
"""Seconds any one wait may take: engines start slowly on a loaded CI machine (2 shared cores)."""
FLEET = "tiny"
# Kopf's lines when an operator acts on a fleet: a handler ran, or a daemon started.
ACTED = re.compile(r"Handler '(on_fleet_change|on_refit)[^']*' succeeded|Daemon '(observe|poll_refit)' ")


@pytest.fixture
def operators(
    crds: None, pod_runner: runner.Runner, kubeconfig: Path, tmp_path: Path
) -> Iterator[operators_module.Operators]:
    """Operator processes of the test's own, watching ``o-*`` namespaces."""
    started = operators_module.Operators(kubeconfig, tmp_path, "o-*")
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def own_namespace(kube_admin: kube.Kube) -> Iterator[str]:
    name = kube_admin.create_namespace("o")
    yield name
    kube_admin.delete(f"/api/v1/namespaces/{name}", missing_ok=True)


def _phase(obj: Object | None) -> str | None:
    phase = (obj or {}).get("status", {}).get("phase")
    return None if phase is None else str(phase)


def _start_refit(kube_admin: kube.Kube, namespace: str) -> tuple[str, sdk.WeightSender, int]:
    """Create Refit ``tiny-v1`` from a rendezvous, wait until the operator published its membership,
    and connect the trainer's sender (every member joined): its path, the sender, the attempt."""
    port = base.free_port()
    kube_admin.create(
        base.refits(namespace),
        {
            "apiVersion": "megafleet.dev/v1alpha1",
            "kind": "Refit",
            "metadata": {"name": f"{FLEET}-v1"},
            "spec": {
                "fleetRef": {"name": FLEET},
                "version": 1,
                "source": {"rendezvous": {"address": base.TRAINER_ADDRESS, "port": port, "trainerWorldSize": 1}},
            },
        },
    )
    path = f"{base.refits(namespace)}/{FLEET}-v1"
    running = kube_admin.wait(path, lambda r: _phase(r) == "Running", timeout=WAIT, what="the Refit Running")
    assert running is not None
    membership, attempt = running["status"]["membership"], int(running["status"]["attempts"])
    sender = sdk.WeightSender(
        ports.attempt_port(port, attempt), membership["worldSize"], address=base.TRAINER_ADDRESS, timeout_seconds=60
    )
    sender.init()
    return path, sender, attempt


def _all_in(kube_admin: kube.Kube, namespace: str, state: str) -> None:
    """Wait until every engine of the fleet reports ``state``."""
    deadline = time.monotonic() + WAIT
    while set((states := operators_module.agent_states(kube_admin, namespace, FLEET)).values()) != {state}:
        assert time.monotonic() < deadline, f"engines not all {state}: {states}"
        time.sleep(0.2)  # polling the agents (they offer no watch), with a deadline


@pytest.mark.timeout(900)
def test_an_operator_killed_mid_refit_leaves_it_to_its_successor_and_no_engine_suspended(
    operators: operators_module.Operators, kube_admin: kube.Kube, own_namespace: str
) -> None:
    namespace = own_namespace
    first = operators.start()
    kube_admin.create(
        base.fleets(namespace), base.tiny_fleet(replicas=2, refit={**base.DRAIN_IN_PLACE, "timeoutSeconds": 60})
    )
    assert kube_admin.wait(f"{base.fleets(namespace)}/{FLEET}", base.ready, timeout=WAIT) is not None
    trainer = base.TrainerModel()
    path, sender, attempt = _start_refit(kube_admin, namespace)
    parameters = [(n, p.detach()) for n, p in trainer.model.named_parameters()]
    half = threading.Event()
    release = threading.Event()

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        """Half the weights, then wait: the engines are suspended with the version half written."""
        for index, item in enumerate(parameters):
            if index == len(parameters) // 2:
                half.set()
                release.wait(WAIT)
            yield item

    failure: list[BaseException] = []

    def send() -> None:
        try:
            sender.send(weights(), bucket_size_mib=1, version=1)
        except BaseException as error:  # handed to the test thread
            failure.append(error)
        finally:
            sender.close()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    assert half.wait(WAIT)
    _all_in(kube_admin, namespace, "suspended")
    operators.kill(first)  # mid-refit: engines suspended, half the weights on the wire
    release.set()
    thread.join(timeout=WAIT)  # the rest moves with no operator running
    assert not thread.is_alive() and not failure, failure
    operators.start()

    done = kube_admin.wait(path, lambda r: _phase(r) in ("Succeeded", "Failed"), timeout=WAIT, what="a final phase")
    assert done is not None and done["status"]["phase"] == "Succeeded", (done or {}).get("status")
    assert done["status"]["attempts"] == attempt, "the successor finished the attempt, it did not start another"
    fleet = kube_admin.wait(
        f"{base.fleets(namespace)}/{FLEET}",
        lambda o: base.ready(o) and (o or {})["status"].get("weightVersion") == 1,
        timeout=WAIT,
        what="both shards Ready at version 1",
    )
    assert fleet is not None
    assert set(operators_module.agent_states(kube_admin, namespace, FLEET).values()) == {"ready"}
    for entry in fleet["status"]["shards"]:
        assert base.served(kube_admin, namespace, entry["pods"][0]) == (trainer.greedy(12), "1")
    refits = kube_admin.list(base.refits(namespace))["items"]
    assert [r["metadata"]["name"] for r in refits] == [f"{FLEET}-v1"]  # nothing duplicated


@pytest.mark.timeout(900)
def test_an_operator_killed_while_no_trainer_sends_fails_the_refit_and_resumes_every_engine(
    operators: operators_module.Operators, kube_admin: kube.Kube, own_namespace: str
) -> None:
    """The trainer dies with the operator: the successor must not leave the engines suspended for a
    refit nobody will ever send; the Refit ends Failed (attempts exhausted) and every engine serves
    its old weights again."""
    namespace = own_namespace
    first = operators.start()
    kube_admin.create(
        base.fleets(namespace), base.tiny_fleet(replicas=2, refit={**base.DRAIN_IN_PLACE, "timeoutSeconds": 10})
    )
    assert kube_admin.wait(f"{base.fleets(namespace)}/{FLEET}", base.ready, timeout=WAIT) is not None
    path, sender, _ = _start_refit(kube_admin, namespace)
    _all_in(kube_admin, namespace, "suspended")
    operators.kill(first)
    sender.abort()  # the trainer is gone too
    sender.close()
    operators.start()

    done = kube_admin.wait(path, lambda r: _phase(r) in ("Succeeded", "Failed"), timeout=WAIT, what="a final phase")
    assert done is not None and done["status"]["phase"] == "Failed", (done or {}).get("status")
    try:
        fleet = kube_admin.wait(
            f"{base.fleets(namespace)}/{FLEET}",
            lambda o: base.ready(o) and not (o or {})["status"].get("refit", {}).get("active"),
            timeout=WAIT,
        )
    except kube.WaitTimeout:
        shards = (kube_admin.get(f"{base.fleets(namespace)}/{FLEET}") or {})["status"]["shards"]
        states = operators_module.agent_states(kube_admin, namespace, FLEET)
        raise AssertionError(f"the fleet is not Ready again: shards {shards}, engines {states}") from None
    assert fleet is not None and fleet["status"].get("weightVersion") == 0
    assert set(operators_module.agent_states(kube_admin, namespace, FLEET).values()) == {"ready"}


@pytest.mark.timeout(900)
def test_two_operators_started_together_keep_one_acting_and_the_other_takes_over(
    operators: operators_module.Operators, kube_admin: kube.Kube, own_namespace: str, tmp_path: Path
) -> None:
    """Both replicas start at the same moment with a fleet already waiting (the race a rolling
    upgrade or a double start gives): only the higher priority ever acts (each replica announces
    itself and settles before Kopf's first look at the peering, :mod:`megafleet.peering`); the lower one logs no
    handler or daemon until the active one is SIGKILLed, then it takes over (a scale change)."""
    namespace = own_namespace
    peering = f"peering-{tmp_path.name[-12:].lower().replace('_', '-')}"
    kube_admin.create(
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}},
    )
    kube_admin.create(base.fleets(namespace), base.tiny_fleet(replicas=1))
    standby = operators.start(peering=peering, priority=10)
    active = operators.start(peering=peering, priority=20)
    standby_log, active_log = operators.logs

    assert kube_admin.wait(f"{base.fleets(namespace)}/{FLEET}", base.ready, timeout=WAIT) is not None
    peers = kube_admin.get(f"/apis/kopf.dev/v1/clusterkopfpeerings/{peering}")
    assert sorted(p["priority"] for p in ((peers or {}).get("status") or {}).values()) == [10, 20]
    assert ACTED.search(active_log.read_text())
    assert not ACTED.search(standby_log.read_text()), standby_log.read_text()[-3000:]

    operators.kill(active)
    kube_admin.patch(f"{base.fleets(namespace)}/{FLEET}/scale", {"spec": {"replicas": 2}})
    grown = kube_admin.wait(
        f"{base.fleets(namespace)}/{FLEET}",
        lambda o: base.ready(o) and o is not None and o["status"]["readyReplicas"] == 2,
        timeout=WAIT,
        what="the standby scaled the fleet",
    )
    assert grown is not None and standby.poll() is None
    assert ACTED.search(standby_log.read_text())
    pods = kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"]
    assert sorted(p["metadata"]["name"] for p in pods) == [f"{FLEET}-s0-p0", f"{FLEET}-s1-p0"]
