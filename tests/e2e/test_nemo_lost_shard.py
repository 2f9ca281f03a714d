"""NeMo RL keeps training when a generation shard dies (its refit membership and fleet health), end to
end (docs/nemo-rl.md, "Losing and regaining shards").

The real local control plane, the operator and two tiny CPU engine pods; NeMo RL's policy side is
:class:`helpers.nemo_trainer.PolicyWorkers` in a Ray actor, NeMo's fleet-health monitor the stand-in
of :mod:`helpers.nemo_fleet_health`, attached with ``attach_fleet_health``. After one refit over both
shards, shard 1's pod is deleted: its session breaks (``MemberLost``), the monitor learns the shard is
out of service, and NeMo's ``CollectiveWeightSynchronizer`` rebuilds over the survivor in its order
(``set_refit_membership``, the refit info again, the sender spec, both sides' ``init_collective`` /
``rebuild_collective`` on a fresh port); the next refit succeeds on shard 0 alone. The killed shard
heals meanwhile and stays ``Stale`` (the monitor: ``stale``); the rebuild that names it again and the
refit after it make it current (the monitor: ``healthy``), serving the trainer's tokens and logprobs.
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


def rebuild(generation: nemo.MegafleetGeneration, policy: Any, survivors: list[int]) -> None:
    """NeMo's ``CollectiveWeightSynchronizer`` rebuild over ``survivors``, in its order: the membership
    recorded first, the refit info sent again, the sender spec read, then both sides' collectives on a
    fresh port (the test's trainer ends its ranks of the old world first, as NeMo's re-init does)."""
    membership = nemo_fleet_health.plan_refit_membership(survivors, per_shard=1, train_world_size=TRAINER_RANKS)
    generation.set_refit_membership(membership)
    generation.prepare_refit_info(ray.get(policy.prepare_refit_info.remote(), timeout=WAIT))
    spec = generation.get_collective_sender_spec()
    assert spec.buffer_size_bytes == BUCKET
    assert ray.get(policy.shutdown.remote(), timeout=WAIT) == []
    port = refit_harness.free_port(nemo_trainer.ADDRESS)
    futures_train = [
        policy.init_collective.remote(
            nemo_trainer.ADDRESS, port, membership.world_size, train_world_size=membership.train_world_size
        )
    ]
    futures_inference = generation.rebuild_collective(membership, nemo_trainer.ADDRESS, port)
    assert all(ray.get(futures_train + futures_inference, timeout=WAIT))


def refit(generation: nemo.MegafleetGeneration, policy: Any, step: int) -> None:
    """GRPO's non-colocated refit: the trainer broadcasts, the fleet receives, then ``ray.get``."""
    futures_train = [policy.broadcast_weights_for_collective.remote(step)]
    futures_inference = generation.update_weights_from_collective()
    assert ray.get(futures_train, timeout=WAIT)[0] >= 1
    assert all(ray.get(futures_inference))
    assert generation.weight_version == step


def test_a_shard_lost_mid_run_is_rebuilt_around_and_current_again_only_after_a_refit_once_it_rejoins(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path, local_ray: None
) -> None:
    fleet_path = f"{refit_e2e.fleets(namespace)}/tiny"
    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet(refit={"bucketSizeMiB": 1}))
    factory = nemo.nemo_factory(
        "tiny", namespace, kubeconfig=kubeconfig, addressing="pod", ready_timeout_s=WAIT, trainer_bucket_bytes=BUCKET
    )
    config = {"generation": {"max_new_tokens": nemo_serving.MAX_TOKENS, "temperature": 1.0, "_pad_token_id": 0}}
    generation = factory(config=config)
    policy: Any = ray.remote(num_cpus=0)(nemo_trainer.PolicyWorkers).remote(bucket_bytes=BUCKET, timeout=WAIT)
    monitor = nemo_fleet_health.Monitor(2)
    try:
        assert generation.prepare_for_generation()
        generation.attach_fleet_health(monitor, selector=object())
        assert monitor.serving_shards() == [0, 1]

        # init_communicator (the collective synchronizer's order) over every shard, and one refit
        generation.prepare_refit_info(ray.get(policy.prepare_refit_info.remote(), timeout=WAIT))
        assert generation.get_collective_sender_spec().buffer_size_bytes == BUCKET
        port = refit_harness.free_port(nemo_trainer.ADDRESS)
        world = TRAINER_RANKS + 2
        futures_train = [policy.init_collective.remote(nemo_trainer.ADDRESS, port, world, train_world_size=2)]
        futures_inference = generation.init_collective(nemo_trainer.ADDRESS, port, world, train_world_size=2)
        assert all(ray.get(futures_train + futures_inference, timeout=WAIT))
        refit(generation, policy, 1)
        [first] = kube_admin.list(sessions(namespace))["items"]
        assert "shards" not in first["spec"], "every shard until NeMo names a membership"

        # shard 1's pod is deleted mid-run: its session breaks, the monitor takes it out of service
        kube_admin.delete(f"/api/v1/namespaces/{namespace}/pods/tiny-s1-p0")
        broken = kube_admin.wait(
            f"{sessions(namespace)}/{first['metadata']['name']}",
            lambda o: (o or {}).get("status", {}).get("phase") == "Broken",
            timeout=WAIT,
            what="the session Broken",
        )
        assert (kube.condition(broken, "Broken") or {}).get("reason") == "MemberLost", broken
        kube_admin.wait(fleet_path, lambda o: shard(o, 1).get("phase") != "Ready", timeout=WAIT, what="shard 1 out")
        generation.sync_fleet_health()
        assert monitor.serving_shards() == [0], monitor.states

        # NeMo's next rebuild goes on with the survivor, and the next refit succeeds on it
        rebuild(generation, policy, monitor.serving_shards())
        [second] = kube_admin.list(sessions(namespace))["items"]
        assert second["spec"]["shards"] == [0] and second["spec"]["nemoCollective"]["worldSize"] == TRAINER_RANKS + 1
        refit(generation, policy, 2)
        nemo_serving.check_serves(generation, 2, version=2)

        # the killed shard heals and stays Stale while it is outside the trainer's world
        healed = kube_admin.wait(
            fleet_path, lambda o: shard(o, 1).get("phase") == "Stale", timeout=WAIT, what="shard 1 healed, Stale"
        )
        assert healed is not None and healed["status"]["refit"]["currentVersion"] == 2
        assert shard(healed, 1).get("weightVersion") in (None, 0, 1), shard(healed, 1)
        generation.sync_fleet_health()
        assert monitor.state_of(1) is ShardState.STALE, monitor.states

        # the rebuild that names it again, then a completed refit: current and healthy again
        rebuild(generation, policy, [0, 1])
        assert shard(kube_admin.get(fleet_path), 1).get("phase") == "Stale", "joining is not a refit"
        refit(generation, policy, 3)
        current = kube_admin.wait(
            fleet_path,
            lambda o: all((shard(o, i).get("phase"), shard(o, i).get("weightVersion")) == ("Ready", 3) for i in (0, 1)),
            timeout=WAIT,
            what="both shards Ready at version 3",
        )
        assert current is not None
        generation.sync_fleet_health()
        assert monitor.serving_shards() == [0, 1] and ("report_refit", 1) in monitor.calls, monitor.calls
        nemo_serving.check_serves(generation, 3, version=3)
    finally:
        generation.shutdown()
        failures = ray.get(policy.shutdown.remote(), timeout=WAIT)
        ray.kill(policy)
    assert failures == []
    refits = kube_admin.list(refit_e2e.refits(namespace))["items"]
    assert sorted((r["spec"]["version"], r["status"]["phase"]) for r in refits) == [
        (version, "Succeeded") for version in (1, 2, 3)
    ]
