"""NeMo RL's trainer holding a fleet's world through a RefitSession, step after step, for the end-to-end
tests of scaling a held fleet (it holds no tests): tests/e2e/test_nemo_scale_held.py (``kubectl
scale``) and tests/e2e/test_nemo_autoscale_held.py (KEDA).

NeMo RL's policy side is :class:`helpers.nemo_trainer.PolicyWorkers` in a Ray actor, NeMo's
fleet-health monitor the stand-in of :mod:`helpers.nemo_fleet_health`, attached with
``attach_fleet_health``. Each :meth:`Trainer.step` is NeMo's ``_sync_weights``: the monitor pumped,
the refit membership reconciled (NeMo's ``desired_membership``: every tracked shard not absent; a
rebuild in NeMo's order when it differs from the one built), then the refit. :func:`training` starts the
run (the communicator over every shard and a first step, version 1) and ends it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from helpers import nemo_fleet_health, nemo_serving, nemo_trainer, refit_e2e, refit_harness
from megafleet.objects import Object
from megafleet.sdk import nemo
from megafleet.sdk.nemo import factory as bound
from megafleet_dev import kube

WAIT = refit_e2e.WAIT
FLEET = "tiny"
TRAINER_RANKS = 2
BUCKET = 64 * 1024  # the trainer's packed-bucket target (a few buckets of the tiny model)
CONFIG = {"generation": {"max_new_tokens": nemo_serving.MAX_TOKENS, "temperature": 1.0, "_pad_token_id": 0}}


def sessions(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/refitsessions"


def fleet_path(namespace: str) -> str:
    return f"{refit_e2e.fleets(namespace)}/{FLEET}"


def shard(fleet: Object | None, index: int) -> Object:
    return next((s for s in (fleet or {}).get("status", {}).get("shards", []) if s["index"] == index), {})


def message(fleet: Object | None) -> str:
    return str((kube.condition(fleet, "RefitSessionHeld") or {}).get("message", ""))


class Trainer:
    """NeMo's side of the run: the policy actor, the generation and the membership built last;
    :attr:`factory` makes more adapters of the fleet (NeMo's rollout workers', other configs)."""

    def __init__(self, factory: type[bound.BoundGeneration], policy: Any, monitor: nemo_fleet_health.Monitor) -> None:
        self.factory, self.policy, self.monitor = factory, policy, monitor
        self.generation = factory(config=CONFIG)
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


@contextlib.contextmanager
def training(namespace: str, kubeconfig: Path, shards: int) -> Iterator[Trainer]:
    """A trainer holding fleet :data:`FLEET` of ``shards`` (created by the caller) after its first step
    (version 1), in a local Ray; at the end its generation is shut down and its ranks have failed
    nothing."""
    factory = nemo.nemo_factory(
        FLEET, namespace, kubeconfig=kubeconfig, addressing="pod", ready_timeout_s=WAIT, trainer_bucket_bytes=BUCKET
    )
    policy: Any = ray.remote(num_cpus=0)(nemo_trainer.PolicyWorkers).remote(bucket_bytes=BUCKET, timeout=WAIT)
    trainer = Trainer(factory, policy, nemo_fleet_health.Monitor(shards))
    try:
        assert trainer.generation.prepare_for_generation()
        trainer.generation.attach_fleet_health(trainer.monitor, selector=object())
        trainer.init_communicator()
        assert not trainer.step(1)
        yield trainer
    finally:
        trainer.generation.shutdown()
        failures = ray.get(policy.shutdown.remote(), timeout=WAIT)
        ray.kill(policy)
    assert failures == []


def refits_succeeded(kube_admin: kube.Kube, namespace: str, versions: range) -> None:
    """The fleet's Refits are exactly ``versions``, every one Succeeded."""
    refits = kube_admin.list(refit_e2e.refits(namespace))["items"]
    assert sorted((r["spec"]["version"], r["status"]["phase"]) for r in refits) == [
        (version, "Succeeded") for version in versions
    ]
