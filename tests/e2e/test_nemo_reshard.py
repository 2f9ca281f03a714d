"""NeMo RL's M-to-N reshard (``refit_transport: nccl_reshard``) of a fleet, end to end (docs/nemo-rl.md).

The real local control plane, the operator and two tiny CPU engine pods (one rank each); NeMo RL's
policy side is :class:`helpers.nemo_reshard_policy.ReshardPolicyWorkers` in a Ray actor (its own
process: two pipeline stages of one trainer rank, each stage's first rank hosting its store, gloo
standing in for NCCL); the test plays NeMo's ``NcclReshardWeightSynchronizer`` with a local Ray and
:class:`megafleet.sdk.nemo.MegafleetGeneration` through ``nemo_factory``: ``init_communicator``
(``init_collective``, ``init_nccl_reshard_comm_group``, ``prepare_nccl_reshard_refit_info``), then
``sync_weights`` twice. The operator has the members join NeMo's world, then both stages' communicators
(``ReshardJoined``); each Refit through the session reaches the engines' reshard route, each engine
takes in only its stripe of every FFN projection from the stages and the rest from its replica, and
the fleet serves the trainer's greedy tokens and logprobs at each version.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from helpers import nemo_collector, nemo_reshard_policy, nemo_serving, nemo_trainer, refit_e2e, refit_harness
from helpers import nemo_reshard_trainer as trainer
from megafleet.sdk import nemo
from megafleet_dev import kube

WAIT = refit_e2e.WAIT
LAYOUT = trainer.Layout(pp=2, tp=1, gen_ranks=2, gen_tp=1, layers=2)  # the tiny Llama's two layers
BUCKET = 64 * 1024  # the misc tensors' packed buckets


@pytest.fixture
def local_ray() -> Iterator[None]:
    with nemo_collector.local_ray():
        yield


def test_two_pipeline_stages_reshard_into_two_shards_through_a_refit_session(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path, local_ray: None
) -> None:
    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet())
    factory = nemo.nemo_factory(
        "tiny", namespace, kubeconfig=kubeconfig, addressing="pod", ready_timeout_s=WAIT, trainer_bucket_bytes=BUCKET
    )
    config = {"generation": {"max_new_tokens": nemo_serving.MAX_TOKENS, "temperature": 1.0, "_pad_token_id": 0}}
    generation = factory(config=config)
    policy: Any = ray.remote(num_cpus=0)(nemo_reshard_policy.ReshardPolicyWorkers).remote(
        layout=LAYOUT, bucket_bytes=BUCKET, timeout=WAIT
    )
    address, train_world = nemo_trainer.ADDRESS, LAYOUT.train_ranks
    try:
        assert generation.prepare_for_generation()
        # init_communicator: NeMo's world (the misc tensors'), then one communicator per pipeline stage
        port = refit_harness.free_port(address)
        futures_train = [policy.init_collective.remote(address, port, train_world + 2, train_world_size=train_world)]
        futures_inference = generation.init_collective(address, port, train_world + 2, train_world_size=train_world)
        assert all(ray.get(futures_train + futures_inference, timeout=WAIT))
        stage_ports = [refit_harness.free_port(address) for _ in range(LAYOUT.pp)]
        stages: dict[str, Any] = {"pp_ips": [address] * LAYOUT.pp, "pp_ports": stage_ports, "pp_size": LAYOUT.pp}
        futures_train = [
            policy.init_nccl_reshard_comm_group.remote(
                **stages, pp_stages=[0, 1], sub_world_size=3, ranks_in_group=[0, 0]
            )
        ]
        futures_inference = generation.init_nccl_reshard_comm_group(**stages, train_ranks_per_stage=1, sub_world_size=3)
        assert all(ray.get(futures_train + futures_inference, timeout=WAIT))
        generation.prepare_nccl_reshard_refit_info(ray.get(policy.prepare_nccl_reshard_refit_info.remote()))
        [session] = kube_admin.list(f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/refitsessions")["items"]
        assert (kube.condition(session, "ReshardJoined") or {}).get("status") == "True", session["status"]
        assert (kube.condition(session, "RefitInfoAccepted") or {}).get("status") == "True", session["status"]

        for step in (1, 2):  # sync_weights
            futures_train = [policy.nccl_reshard_refit.remote(step)]
            results = generation.nccl_reshard_refit()
            assert ray.get(futures_train, timeout=WAIT)[0] > 0  # the bulk went by the stages
            assert all(result for result in results if result is not None)
            assert generation.weight_version == step
            nemo_serving.check_serves(generation, step, version=step)
    finally:
        generation.shutdown()
        failures = ray.get(policy.shutdown.remote(), timeout=WAIT)
        ray.kill(policy)
    assert failures == []
    refits = kube_admin.list(refit_e2e.refits(namespace))["items"]
    assert sorted((r["spec"]["version"], r["status"]["phase"]) for r in refits) == [(1, "Succeeded"), (2, "Succeeded")]
