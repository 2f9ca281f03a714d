"""The two-phase commit end to end on the two-shard tiny CPU fleet (staging ``auto``, integrity
``checksum``), against the real control plane, the operator and engine pods run by the local runner,
while eight long greedy streams run.

* ``commit: trainer`` over the megafleet wire (reshard): the trainer's bucket to shard 0 is corrupt
  (the sender's test hook flips a byte after its digest, that receiver only). Shard 0 does not stage,
  so the trainer refuses its commit and shard 1, which staged, discards its copy: every attempt fails,
  the Refit ends Failed ``BucketMismatch`` naming the bucket, and NO shard switched: every streamed
  token is version 0's, every stream's spans are one span of version 0, the fleet stays at version 0.
* ``commit: operator`` (a checkpoint, on a fleet without integrity):
  every member stages, the operator records
  ``status.commit.decidedTime`` and tells both to switch; every stream spans the switch, both shards
  serve version 1.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from helpers import inflight_streams as inflight
from helpers import refit_e2e
from megafleet.objects import Object
from megafleet_dev import kube
from megafleet_engine.models import tiny
from megafleet_protocol import ports
from megafleet_protocol.refit import errors
from megafleet_protocol.refit import sender as sdk

STREAM_TOKENS = 300  # long enough to span the refit, short enough for a loaded 2-core machine
COMMITTED = {
    "staging": "auto",
    "integrity": "checksum",
    "transport": "reshard",
    "commit": "trainer",
    "timeoutSeconds": 60,
    "commitGraceSeconds": 5,
}


def create_fleet(kube_admin: kube.Kube, namespace: str, refit: dict[str, Any]) -> Object:
    manifest = inflight.long_fleet()
    manifest["spec"]["refit"] = {**manifest["spec"].get("refit", {}), **refit}
    kube_admin.create(refit_e2e.fleets(namespace), manifest)
    ready = kube_admin.wait(f"{refit_e2e.fleets(namespace)}/tiny", refit_e2e.ready, timeout=refit_e2e.WAIT)
    assert ready is not None and ready["status"]["weightVersion"] == 0
    return ready


@pytest.fixture
def fleet(operator: object, kube_admin: kube.Kube, namespace: str) -> Object:
    return create_fleet(kube_admin, namespace, COMMITTED)


@pytest.fixture
def operator_fleet(operator: object, kube_admin: kube.Kube, namespace: str) -> Object:
    """Staged, the operator commits (integrity none: the parameter digests are not asked for here)."""
    return create_fleet(kube_admin, namespace, {"staging": "auto", "commit": "operator"})


class CorruptTrainer:
    """Sends every attempt of one rendezvous Refit with bucket 0 to group rank 1 (shard 0) corrupt,
    on a thread, until the Refit ends; keeps what each send raised."""

    def __init__(self, kube_admin: kube.Kube, path: str, port: int, version: int) -> None:
        self.kube_admin, self.path, self.port, self.version = kube_admin, path, port, version
        model, _ = tiny.build_tiny(inflight.NEW_SOURCE)
        self.weights = {name: parameter.detach() for name, parameter in model.named_parameters()}
        self.failures: dict[int, BaseException] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 4 * refit_e2e.WAIT
        while time.monotonic() < deadline:
            status: dict[str, Any] = (self.kube_admin.get(self.path) or {}).get("status") or {}
            if status.get("phase") in refit_e2e.REFIT_ENDED:
                return
            attempt = int(status.get("attempts") or 0)
            if status.get("phase") == "Running" and attempt not in self.failures:
                self.failures[attempt] = self._send(attempt, status["membership"]["worldSize"])
            time.sleep(0.2)  # polling the Refit's status for its next attempt, with a deadline

    def _send(self, attempt: int, world_size: int) -> BaseException:
        sender = sdk.WeightSender(
            ports.attempt_port(self.port, attempt),
            world_size,
            address=refit_e2e.TRAINER_ADDRESS,
            timeout_seconds=60,
            corrupt_bucket=0,
            corrupt_receiver=1,
        )
        try:
            sender.init()
            sender.send(self.weights.items(), bucket_size_mib=1, version=self.version, transport="reshard")
        except errors.RefitError as error:
            return error
        finally:
            sender.close()
        raise AssertionError(f"attempt {attempt} succeeded although shard 0's bucket was corrupt")


@pytest.mark.timeout(900)  # two attempts, then eight 1,200-token streams to their end
def test_a_bucket_corrupt_on_one_shard_fails_the_refit_and_no_shard_switches(
    fleet: Object, kube_admin: kube.Kube, namespace: str
) -> None:
    running = inflight.start_streams(inflight.frontends(kube_admin, namespace, fleet), STREAM_TOKENS)
    port = refit_e2e.free_port()
    path = refit_e2e.create_refit(kube_admin, namespace, "tiny", 1, port=port)
    trainer = CorruptTrainer(kube_admin, path, port, 1)

    result = kube_admin.wait(path, refit_e2e.refit_ended, timeout=4 * refit_e2e.WAIT, what="the refit to end")
    trainer.thread.join(timeout=refit_e2e.WAIT)
    loads = inflight.finish(running)

    assert result is not None
    status = result["status"]
    assert status["phase"] == "Failed", status
    failed = kube.condition(result, "Failed")
    assert failed is not None and failed["reason"] == "BucketMismatch", failed
    assert status["verification"]["mismatch"]["bucket"] == 0 and status["verification"]["mismatch"]["shard"] == 0
    assert status["commit"] == {"requested": "trainer", "mode": "trainer"}  # the trainer never committed
    assert trainer.failures and all(isinstance(error, errors.ReceiverFailed) for error in trainer.failures.values())
    for stream in inflight.streams_of(loads):
        assert stream.error is None, stream.error
        assert stream.finish_reason == "length" and stream.versions == [0] * STREAM_TOKENS
        assert stream.plain_spans() == [{"start": 0, "version": 0}]
    after = kube_admin.get(f"{refit_e2e.fleets(namespace)}/tiny")
    assert after is not None and after["status"]["weightVersion"] == 0
    assert (after["status"].get("refit") or {}).get("currentVersion") in (None, 0)
    assert [shard["phase"] for shard in after["status"]["shards"]] == ["Ready", "Ready"]
    for shard in after["status"]["shards"]:
        assert refit_e2e.served(kube_admin, namespace, shard["pods"][0])[1] == "0"


@pytest.mark.timeout(900)  # eight 1,200-token streams to their end
def test_an_operator_decided_commit_switches_both_shards(
    operator_fleet: Object, kube_admin: kube.Kube, namespace: str
) -> None:
    running = inflight.start_streams(inflight.frontends(kube_admin, namespace, operator_fleet), STREAM_TOKENS)

    path = inflight.create_refit(kube_admin, namespace, 1, inflight.NEW_SOURCE, inFlight="keep", kvCacheMode="persist")
    result = kube_admin.wait(path, refit_e2e.refit_ended, timeout=refit_e2e.WAIT, what="the refit to end")
    loads = inflight.finish(running)

    assert result is not None
    status = result["status"]
    assert status["phase"] == "Succeeded", status
    assert status["commit"]["mode"] == "operator" and status["commit"]["decidedTime"]
    assert status["staging"]["effective"] == "staged"
    assert inflight.check_kept(loads, "persist") == inflight.STREAMS
    after = kube_admin.get(f"{refit_e2e.fleets(namespace)}/tiny")
    assert after is not None and after["status"]["refit"]["currentVersion"] == 1
    for shard in after["status"]["shards"]:
        assert refit_e2e.served(kube_admin, namespace, shard["pods"][0])[1] == "1"
