"""RefitSession end to end: the test plays an unmodified NeMo RL trainer (two ranks on threads,
:mod:`helpers.nemo_trainer`: a store that waits for every rank, the warm-up, NeMo's packed
broadcasts over gloo) and writes the RefitSession, its refit info ConfigMap and the Refits by hand,
as the adapter would. The real operator joins the fleet's two tiny CPU engines to the trainer's
world with the membership it publishes, three session refits bring every frontend to the
trainer's weights, a ``kubectl scale`` places its new shard outside the held world (it joins at the
trainer's next rebuild; the session's membership is unchanged), and a killed member breaks the next
session (``MemberLost``)."""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import json
import os
import queue
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from helpers import nemo_trainer, refit_e2e
from helpers import refit_harness as harness
from megafleet_dev import kube, runner
from megafleet_engine.models import tiny
from megafleet_protocol import ports

TRAINER_RANKS = 2
BUCKET_BYTES = 16384  # several buckets for the tiny model
SEND_SECONDS = 60.0


def sessions(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/refitsessions"


class TrainerWorld:
    """NeMo's trainer ranks 0..T-1 of one world on threads: each joins (rank 0's store waits for
    every rank), then broadcasts each version handed to :meth:`send` (until :meth:`finish`)."""

    def __init__(self, world_size: int) -> None:
        self.port = harness.free_port()
        self.world_size = world_size
        self.sent: list[int] = []
        self.joined = [threading.Event() for _ in range(TRAINER_RANKS)]
        self._next: list[queue.Queue[list[torch.Tensor] | None]] = [queue.Queue() for _ in range(TRAINER_RANKS)]
        unique_id = os.urandom(128)
        ranks = [
            functools.partial(
                nemo_trainer.trainer_rank,
                rank,
                port=self.port,
                world_size=world_size,
                tensors=[],
                target=BUCKET_BYTES,
                generation="nemo",
                unique_id=unique_id,
                sent=self.sent,
                later=iter(functools.partial(self._next[rank].get, timeout=300), None),
                prefix=nemo_trainer.AGENT_GLOO_PREFIX,
                joined=self.joined[rank],
            )
            for rank in range(TRAINER_RANKS)
        ]
        self._running = nemo_trainer.running(*ranks, timeout=SEND_SECONDS)
        self.failures = self._running.__enter__()

    def send(self, weights: dict[str, torch.Tensor]) -> None:
        """``broadcast_weights_for_collective``: every trainer rank takes part, rank 0's data goes out."""
        for rank, next_refit in enumerate(self._next):
            next_refit.put([tensor if rank == 0 else torch.empty_like(tensor) for tensor in weights.values()])

    def finish(self) -> None:
        for next_refit in self._next:
            next_refit.put(None)
        self._running.__exit__(None, None, None)
        assert not self.failures, self.failures


@pytest.fixture
def trainers() -> Iterator[list[TrainerWorld]]:
    started: list[TrainerWorld] = []
    yield started
    for world in started:
        world.finish()


def trainer_model(seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model, _ = tiny.build_tiny(f"tiny://llama?seed={seed}")
    return model, {name: parameter.detach() for name, parameter in model.named_parameters()}


def greedy(model: Any) -> list[int]:
    inputs = torch.tensor([refit_e2e.PROMPT])
    with torch.inference_mode():
        output = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=12)
    return [int(token) for token in output[0, len(refit_e2e.PROMPT) :]]


def create_session(
    kube_admin: kube.Kube, namespace: str, name: str, trainer: TrainerWorld, info: dict[str, torch.Tensor]
) -> None:
    """What the adapter writes at ``init_collective``: the refit info ConfigMap, then the session."""
    entries = [[name, list(tensor.shape), str(tensor.dtype)] for name, tensor in info.items()]
    packed = gzip.compress(json.dumps(entries).encode())
    kube_admin.create(
        f"/api/v1/namespaces/{namespace}/configmaps",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-refit-info"},
            "immutable": True,
            "binaryData": {"refitInfo.json.gz": base64.b64encode(packed).decode()},
        },
    )
    kube_admin.create(
        sessions(namespace),
        {
            "apiVersion": "megafleet.dev/v1alpha1",
            "kind": "RefitSession",
            "metadata": {"name": name},
            "spec": {
                "fleetRef": {"name": "tiny"},
                "nemoCollective": {
                    "address": nemo_trainer.ADDRESS,
                    "port": trainer.port,
                    "worldSize": trainer.world_size,
                    "trainerWorldSize": TRAINER_RANKS,
                    "bucketBytes": BUCKET_BYTES,
                },
                "refitInfo": {
                    "configMapRef": {"name": f"{name}-refit-info", "key": "refitInfo.json.gz"},
                    "sha256": hashlib.sha256(packed).hexdigest(),
                    "tensors": len(entries),
                },
                "joinTimeoutSeconds": 60,
            },
        },
    )


def world_of(kube_admin: kube.Kube, namespace: str, pod: str) -> dict[str, Any]:
    """What a member pod's agent reports about the trainer's world (``world`` of its refit status)."""
    secret = kube_admin.get(f"/api/v1/namespaces/{namespace}/secrets/tiny-agent-token")
    found = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
    assert secret is not None and found is not None
    token = base64.b64decode(secret["data"]["token"]).decode()
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=10) as agent:
        response = agent.get(f"http://{found['status']['podIP']}:{ports.AGENT_PORT}/v1/refit/status")
    assert response.status_code == 200, response.text
    world: dict[str, Any] = response.json()["world"]
    return world


def phase_in(*phases: str) -> Any:
    return lambda obj: (obj or {}).get("status", {}).get("phase") in phases


def test_a_trainer_world_is_joined_refitted_held_released_and_broken_by_a_lost_member(
    operator: Path,
    kube_admin: kube.Kube,
    namespace: str,
    pod_runner: runner.Runner,
    trainers: list[TrainerWorld],
) -> None:
    fleets = refit_e2e.fleets(namespace)
    kube_admin.create(fleets, refit_e2e.tiny_fleet())
    assert kube_admin.wait(f"{fleets}/tiny", refit_e2e.ready, timeout=refit_e2e.WAIT, what="tiny Ready")
    models = {version: trainer_model(seed) for version, seed in ((1, 7), (2, 8), (3, 9))}

    # init_collective: the trainer's store waits for all 4 ranks; the operator joins the 2 shards
    trainers.append(TrainerWorld(world_size=TRAINER_RANKS + 2))
    world = trainers[0]
    create_session(kube_admin, namespace, "grpo", world, models[1][1])
    joined = kube_admin.wait(
        f"{sessions(namespace)}/grpo", phase_in("Joined", "Failed"), timeout=refit_e2e.WAIT, what="Joined"
    )
    assert joined is not None and joined["status"]["phase"] == "Joined", joined
    assert all(event.wait(SEND_SECONDS) for event in world.joined), "the trainer's init_collective returned"
    assert joined["status"]["membership"] == {
        "worldSize": 4,
        "trainerWorldSize": 2,
        "rankOffsets": [{"shard": 0, "offset": 2}, {"shard": 1, "offset": 3}],
    }
    assert joined["status"]["generation"] == "nemo"
    fleet = kube_admin.get(f"{fleets}/tiny")
    assert fleet is not None and fleet["status"]["refit"]["session"] == "grpo"
    uid = joined["metadata"]["uid"]
    worlds = [world_of(kube_admin, namespace, pod) for pod in ("tiny-s0-p0", "tiny-s1-p0")]
    assert [(w["session"], w["phase"], w["rank"]) for w in worlds] == [(uid, "joined", 2), (uid, "joined", 3)]

    # three steps: the trainer broadcasts, a Refit through the session receives it
    for version, (model, weights) in models.items():
        world.send(weights)
        kube_admin.create(
            refit_e2e.refits(namespace),
            {
                "apiVersion": "megafleet.dev/v1alpha1",
                "kind": "Refit",
                "metadata": {"name": f"tiny-v{version}"},
                "spec": {"fleetRef": {"name": "tiny"}, "version": version, "source": {"session": {"name": "grpo"}}},
            },
        )
        done = kube_admin.wait(
            f"{refit_e2e.refits(namespace)}/tiny-v{version}",
            phase_in("Succeeded", "Failed"),
            timeout=refit_e2e.WAIT,
            what=f"the refit to version {version}",
        )
        assert done is not None and done["status"]["phase"] == "Succeeded", done
        assert done["status"]["attempts"] == 1
        assert "join" not in {phase["name"] for phase in done["status"]["phases"]}, "a session refit never joins"
        expected = greedy(model)
        for pod in ("tiny-s0-p0", "tiny-s1-p0"):
            assert refit_e2e.served(kube_admin, namespace, pod) == (expected, str(version)), (version, pod)
    session = kube_admin.get(f"{sessions(namespace)}/grpo")
    assert session is not None and session["status"]["lastVersion"] == 3

    # kubectl scale while the world is held: the new shard is placed outside the world, and the
    # condition says it waits for the trainer's next rebuild
    kube_admin.patch(f"{fleets}/tiny/scale", {"spec": {"replicas": 3}})
    joins = "spec.replicas 3: shard 2 joins at the trainer's next rebuild"
    held = kube_admin.wait(
        f"{fleets}/tiny",
        lambda o: joins in (kube.condition(o, "RefitSessionHeld") or {}).get("message", ""),
        timeout=refit_e2e.WAIT,
        what="RefitSessionHeld naming the scale",
    )
    assert held is not None and held["status"]["refit"]["session"] == "grpo"
    assert kube_admin.wait(
        f"/api/v1/namespaces/{namespace}/pods/tiny-s2-p0", lambda o: o is not None, timeout=refit_e2e.WAIT
    ), "placed while held"
    assert [member["shard"] for member in session["status"]["membership"]["rankOffsets"]] == [0, 1]

    # the trainer shuts down: deleting the session makes the members leave and releases the hold
    kube_admin.delete(f"{sessions(namespace)}/grpo")
    released = kube_admin.wait(
        f"{fleets}/tiny",
        lambda o: (kube.condition(o, "RefitSessionHeld") or {}).get("status") == "False",
        timeout=refit_e2e.WAIT,
        what="the hold released",
    )
    assert released is not None and released["status"]["refit"].get("session") is None
    assert kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/tiny-s2-p0") is not None, "the scale stays"
    # The hold is released as soon as the session is deleting; the object itself goes once its delete
    # handler (the members leaving) is through and Kopf drops the finalizer, which may come after.
    kube_admin.wait(f"{sessions(namespace)}/grpo", lambda o: o is None, timeout=refit_e2e.WAIT, what="the session gone")
    for pod in ("tiny-s0-p0", "tiny-s1-p0"):
        assert world_of(kube_admin, namespace, pod)["phase"] == "left", f"{pod} left the trainer's world"

    # a new run's world over the three shards; a member killed while it is held breaks it
    trainers.append(TrainerWorld(world_size=TRAINER_RANKS + 3))
    second = trainers[1]
    create_session(kube_admin, namespace, "grpo-2", second, models[1][1])
    joined = kube_admin.wait(
        f"{sessions(namespace)}/grpo-2", phase_in("Joined", "Failed"), timeout=refit_e2e.WAIT, what="Joined again"
    )
    assert joined is not None and joined["status"]["phase"] == "Joined", joined
    assert [entry["offset"] for entry in joined["status"]["membership"]["rankOffsets"]] == [2, 3, 4]
    kill_engine(pod_runner, namespace, "tiny-s1-p0")
    broken = kube_admin.wait(f"{sessions(namespace)}/grpo-2", phase_in("Broken"), timeout=refit_e2e.WAIT, what="Broken")
    assert broken is not None
    lost = kube.condition(broken, "Broken")
    assert lost is not None and lost["reason"] == "MemberLost" and "shard 1" in lost["message"], lost
    fleet = kube_admin.get(f"{fleets}/tiny")
    assert fleet is not None and fleet["status"]["refit"].get("session") is None, "the hold is released"
    events = kube_admin.wait_items(
        f"/api/v1/namespaces/{namespace}/events",
        lambda items: any(item.get("reason") == "SessionBroken" for item in items),
        field_selector="involvedObject.name=grpo-2",
        timeout=refit_e2e.WAIT,
        what="the SessionBroken Warning",
    )
    warning = next(item for item in events if item.get("reason") == "SessionBroken")
    assert warning["type"] == "Warning" and "shard 1" in warning["message"]


def kill_engine(pod_runner: runner.Runner, namespace: str, pod: str) -> None:
    """SIGKILL the engine process the runner started for ``pod`` (as a crashing GPU would end it)."""
    folder = pod_runner.workdir / namespace / pod
    process = next(p for p in list(pod_runner.processes.values()) if p.log.parent == folder)
    os.killpg(process.popen.pid, signal.SIGKILL)
