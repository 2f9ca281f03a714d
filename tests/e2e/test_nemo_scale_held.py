"""Scaling a fleet while NeMo RL's trainer holds its world, end to end (docs/nemo-rl.md, "Losing and
regaining shards"; :mod:`megafleet.fleet_state.hold`).

The real local control plane, the operator and tiny CPU engine pods; NeMo RL's policy side is
:class:`helpers.nemo_trainer.PolicyWorkers` in a Ray actor, NeMo's fleet-health monitor the stand-in
of :mod:`helpers.nemo_fleet_health`, attached with ``attach_fleet_health``. Each training step is
NeMo's ``_sync_weights``: the monitor pumped, the refit membership reconciled (NeMo's
``desired_membership``: every tracked shard not absent; a rebuild in NeMo's order when it differs from
the one built), then the refit.

``kubectl scale 2 -> 3`` during the session: shard 2 is placed at once, outside the trainer's world,
Stale while the fleet stays held; the next step's rebuild names it and its refit makes it current and
served. ``kubectl scale 3 -> 2``: shard 2 keeps its place in the world (``RefitSessionHeld`` says it
leaves at the trainer's next rebuild), the monitor retires it, the next step's rebuild leaves it out
and the operator removes it; no refit fails. One fleet and one Ray for the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from helpers import nemo_collector, nemo_fleet_health, nemo_serving, nemo_trainer, refit_e2e, refit_harness
from megafleet.objects import Object
from megafleet.sdk import nemo
from megafleet_dev import kube

WAIT = refit_e2e.WAIT
TRAINER_RANKS = 2
BUCKET = 64 * 1024  # the trainer's packed-bucket target (a few buckets of the tiny model)
ShardState = nemo_fleet_health.ShardState


@pytest.fixture
def local_ray() -> Iterator[None]:
    with nemo_collector.local_ray():
        yield


def sessions(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/refitsessions"


def shard(fleet: Object | None, index: int) -> Object:
    return next((s for s in (fleet or {}).get("status", {}).get("shards", []) if s["index"] == index), {})


def held_message(fleet: Object | None) -> str:
    return str((kube.condition(fleet, "RefitSessionHeld") or {}).get("message", ""))


class Trainer:
    """NeMo's side of the run: the policy actor, the generation and the membership built last."""

    def __init__(self, generation: nemo.MegafleetGeneration, policy: Any, monitor: nemo_fleet_health.Monitor) -> None:
        self.generation, self.policy, self.monitor = generation, policy, monitor
        self.built = list(range(monitor.shard_count))

    def init_communicator(self) -> None:
        """The collective synchronizer's ``init_communicator`` over every shard."""
        self.generation.prepare_refit_info(ray.get(self.policy.prepare_refit_info.remote(), timeout=WAIT))
        assert self.generation.get_collective_sender_spec().buffer_size_bytes == BUCKET
        self._collectives(TRAINER_RANKS + len(self.built), None)

    def step(self, version: int) -> bool:
        """NeMo's ``_sync_weights``: the monitor pumped, the membership reconciled, the refit; whether
        the communicator was rebuilt."""
        self.generation.sync_fleet_health()
        members = nemo_fleet_health.desired_members(self.monitor)
        rebuilt = members != self.built
        if rebuilt:
            self._rebuild(members)
        futures_train = [self.policy.broadcast_weights_for_collective.remote(version)]
        futures_inference = self.generation.update_weights_from_collective()
        assert ray.get(futures_train, timeout=WAIT)[0] >= 1
        assert all(ray.get(futures_inference))
        assert self.generation.weight_version == version
        return rebuilt

    def _rebuild(self, members: list[int]) -> None:
        """NeMo's ``reconcile_communicator``: the refit info again, then the membership and both sides'
        collectives on a fresh port (the trainer ends its ranks of the old world first)."""
        membership = nemo_fleet_health.plan_refit_membership(members, per_shard=1, train_world_size=TRAINER_RANKS)
        self.generation.prepare_refit_info(ray.get(self.policy.prepare_refit_info.remote(), timeout=WAIT))
        assert ray.get(self.policy.shutdown.remote(), timeout=WAIT) == []
        self.generation.set_refit_membership(membership)
        self._collectives(membership.world_size, membership)
        self.built = members

    def _collectives(self, world: int, membership: nemo_fleet_health.RefitMembership | None) -> None:
        port = refit_harness.free_port(nemo_trainer.ADDRESS)
        futures_train = [
            self.policy.init_collective.remote(nemo_trainer.ADDRESS, port, world, train_world_size=TRAINER_RANKS)
        ]
        if membership is None:
            futures_inference = self.generation.init_collective(
                nemo_trainer.ADDRESS, port, world, train_world_size=TRAINER_RANKS
            )
        else:
            futures_inference = self.generation.rebuild_collective(membership, nemo_trainer.ADDRESS, port)
        assert all(ray.get(futures_train + futures_inference, timeout=WAIT))


def test_a_scale_out_joins_and_a_scale_in_leaves_the_trainers_world_at_its_next_rebuild(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path, local_ray: None
) -> None:
    fleet_path = f"{refit_e2e.fleets(namespace)}/tiny"
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet(refit={"bucketSizeMiB": 1}))
    factory = nemo.nemo_factory(
        "tiny", namespace, kubeconfig=kubeconfig, addressing="pod", ready_timeout_s=WAIT, trainer_bucket_bytes=BUCKET
    )
    config = {"generation": {"max_new_tokens": nemo_serving.MAX_TOKENS, "temperature": 1.0, "_pad_token_id": 0}}
    generation = factory(config=config)
    policy: Any = ray.remote(num_cpus=0)(nemo_trainer.PolicyWorkers).remote(bucket_bytes=BUCKET, timeout=WAIT)
    monitor = nemo_fleet_health.Monitor(2)
    trainer = Trainer(generation, policy, monitor)
    try:
        assert generation.prepare_for_generation()
        generation.attach_fleet_health(monitor, selector=object())
        trainer.init_communicator()
        assert not trainer.step(1)
        [first] = kube_admin.list(sessions(namespace))["items"]

        # kubectl scale 2 -> 3 while held: shard 2 placed outside the world, Stale, the hold kept
        kube_admin.patch(f"{fleet_path}/scale", {"spec": {"replicas": 3}})
        stale = kube_admin.wait(
            fleet_path, lambda o: shard(o, 2).get("phase") == "Stale", timeout=WAIT, what="shard 2 placed, Stale"
        )
        assert stale is not None and stale["status"]["refit"]["session"] == first["metadata"]["name"]
        assert "spec.replicas 3: shard 2 joins at the trainer's next rebuild" in held_message(stale), held_message(
            stale
        )
        assert shard(stale, 2).get("weightVersion") in (None, 0), shard(stale, 2)

        # the next step's rebuild names it, its refit makes it current and served
        assert trainer.step(2), "rebuilt over the three shards"
        assert monitor.state_of(2) is ShardState.HEALTHY and ("mark_loaded", 2) in monitor.calls, monitor.calls
        [second] = kube_admin.list(sessions(namespace))["items"]
        assert second["spec"]["shards"] == [0, 1, 2] and second["spec"]["nemoCollective"]["worldSize"] == 5
        current = kube_admin.wait(
            fleet_path,
            lambda o: all(
                (shard(o, i).get("phase"), shard(o, i).get("weightVersion")) == ("Ready", 2) for i in range(3)
            ),
            timeout=WAIT,
            what="three shards Ready at version 2",
        )
        assert current is not None
        nemo_serving.check_serves(generation, 2, version=2)

        # kubectl scale 3 -> 2 while held: shard 2 stays in the world until the next step's rebuild
        kube_admin.patch(f"{fleet_path}/scale", {"spec": {"replicas": 2}})
        leaving = kube_admin.wait(
            fleet_path,
            lambda o: "spec.replicas 2: shard 2 leaves at the trainer's next rebuild" in held_message(o),
            timeout=WAIT,
            what="RefitSessionHeld naming the leaving shard",
        )
        assert leaving is not None and kube_admin.get(f"{pods}/tiny-s2-p0") is not None, "kept while in the world"
        assert trainer.step(3), "rebuilt without shard 2"
        assert monitor.state_of(2) is ShardState.RETIRED and trainer.built == [0, 1]
        [third] = kube_admin.list(sessions(namespace))["items"]
        assert third["spec"]["shards"] == [0, 1]
        kube_admin.wait(f"{pods}/tiny-s2-p0", lambda o: o is None, timeout=WAIT, what="shard 2 removed")
        settled = kube_admin.wait(
            fleet_path,
            lambda o: "join" not in held_message(o) and "leave" not in held_message(o) and o is not None,
            timeout=WAIT,
            what="nothing waits",
        )
        assert settled is not None and [s["index"] for s in settled["status"]["shards"]] == [0, 1]
    finally:
        generation.shutdown()
        failures = ray.get(policy.shutdown.remote(), timeout=WAIT)
        ray.kill(policy)
    assert failures == []
    refits = kube_admin.list(refit_e2e.refits(namespace))["items"]
    assert sorted((r["spec"]["version"], r["status"]["phase"]) for r in refits) == [
        (version, "Succeeded") for version in (1, 2, 3)
    ]
